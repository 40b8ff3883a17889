"""Where and how a run computes: its device, its place in the job, the precision of its forwards.

One :class:`Runtime` is built when a trainer starts (:meth:`Runtime.start`) and handed to
everything that runs the model: the packed passes, the engines, the evaluation, the rollout
worker (which builds its own for the device it samples on). Weights, gradients and optimizer
states stay float32; under bf16 the matmuls of every forward (generation, the training and
reference passes, the PPO critic) run in bf16 through ``torch.autocast``.
"""

import contextlib
import dataclasses

import torch

from grpo_fast.trainer import distributed
from grpo_fast.trainer.distributed import Ranks


@dataclasses.dataclass(frozen=True)
class Runtime:
    """device: where the model runs; ranks: this process's place in the job (default: a
    single process); bf16: the forwards run under bf16 autocast (CUDA only)."""

    device: torch.device
    ranks: Ranks | None = None
    bf16: bool = False

    def __post_init__(self):
        if self.ranks is None:
            object.__setattr__(self, "ranks", Ranks(self.device))

    @classmethod
    def start(cls, config) -> "Runtime":
        """The run's runtime: ``config.device`` resolved, torchrun's job joined (see
        ``distributed.setup``), the precision ``config.precision`` gives on that device."""
        device = distributed.resolve_device(config.device)
        return cls(device, distributed.setup(device, config.collective_timeout_s), config.bf16(device))

    @classmethod
    def local(cls, config, device) -> "Runtime":
        """A single process's runtime on ``device`` at the precision ``config`` gives there."""
        device = torch.device(device)
        return cls(device, Ranks(device), config.bf16(device))

    @classmethod
    def of(cls, model) -> "Runtime":
        """The default for a model used outside a run: a single process at float32 on the
        model's device."""
        return cls(next(model.parameters()).device)

    def autocast(self):
        """bf16 autocast on CUDA when asked; a no-op context otherwise."""
        if self.bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def half_weights(self) -> torch.dtype | None:
        """The dtype FSDP2 gathers weights in for the forwards (bf16 on CUDA), or None (as stored)."""
        return torch.bfloat16 if self.bf16 and self.device.type == "cuda" else None

    def flash_attention(self) -> bool:
        """Whether a model here can attend with ``flash_attention_2``: CUDA, 16-bit activations
        (bf16 autocast) and the flash-attn package installed."""
        from transformers.utils import is_flash_attn_2_available

        return self.half_weights is not None and is_flash_attn_2_available()
