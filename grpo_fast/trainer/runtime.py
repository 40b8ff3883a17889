"""Where and how a run computes: its device, its place in the job, the precision of its forwards.

One :class:`Runtime` is built when a trainer starts (:meth:`Runtime.start`) and handed to
everything that runs the model: the packed passes (training, reference, old log-probs), the
engines (sampler, hf, vllm), the evaluation, a strategy's own models, the rollout worker (which
builds its own for the device it samples on). Weights, gradients and optimizer states stay
float32.

What ``--precision`` means is decided here, once per device (:func:`decide_precision`), and
every forward reads that decision:

    precision   on CUDA                              on CPU
    auto        bf16                                 fp32
    bf16        bf16                                 bf16
    fp32        fp32                                 fp32

bf16 is ``torch.autocast(device, bfloat16)`` around every forward of ours and of Hugging Face
``generate`` (the matmuls in bf16, reductions and the loss in float32), FSDP2's weights
gathered in bfloat16, and the vLLM engine loaded with ``dtype=bfloat16``; fp32 runs all of them
in float32. A CUDA device without bf16 refuses ``--precision bf16`` by name, and ``auto`` falls
back to fp32 there with a logged line. The decision is logged once per process
(:meth:`Runtime.log`).
"""

import contextlib
import dataclasses
import logging
import random

import numpy
import torch

from grpo_fast.trainer import distributed
from grpo_fast.trainer.choices import PRECISIONS
from grpo_fast.trainer.distributed import Ranks
from grpo_fast.trainer.sections import DeviceConfig

logger = logging.getLogger("grpo_fast")


def set_seed(seed: int) -> None:
    """Seeds Python's, numpy's and torch's generators (every CUDA device's with torch's):
    ``transformers.set_seed``'s effect, without importing ``transformers.trainer_utils``, which
    imports peft (about 3 s of every process's start)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def decide_precision(precision: str, device: torch.device) -> bool:
    """Whether ``--precision`` ``precision`` runs the forwards on ``device`` in bf16 (see the
    table above): ValueError for a name not in ``choices.PRECISIONS``, or for bf16 on a CUDA
    device that has none."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return False
    bf16_device = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if precision == "bf16" and not bf16_device:
        raise ValueError(f"precision='bf16': {torch.cuda.get_device_name(device)} has no bf16; use fp32 or auto")
    if precision == "auto" and device.type == "cuda" and not bf16_device:
        logger.info("precision auto: %s has no bf16, the forwards run in fp32", torch.cuda.get_device_name(device))
    return bf16_device and (precision == "bf16" or device.type == "cuda")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """device: where the model runs; ranks: this process's place in the job (default: a
    single process); bf16: every forward runs in bf16 (:func:`decide_precision`)."""

    device: torch.device
    ranks: Ranks | None = None
    bf16: bool = False

    def __post_init__(self):
        if self.ranks is None:
            object.__setattr__(self, "ranks", Ranks(self.device))

    @classmethod
    def start(cls, devices: DeviceConfig, precision: str) -> "Runtime":
        """The run's runtime: ``devices.device`` resolved, torchrun's job joined (see
        ``distributed.setup``), ``precision`` decided on that device."""
        device = distributed.resolve_device(devices.device)
        bf16 = decide_precision(precision, device)
        ranks = distributed.setup(device, devices.collective_timeout_s, devices.sequence_parallel)
        return cls(device, ranks, bf16)

    def on(self, device, precision: str) -> "Runtime":
        """This process's runtime moved to ``device`` (a rollout worker's), ``precision`` decided
        there."""
        device = torch.device(device)
        return dataclasses.replace(self, device=device, bf16=decide_precision(precision, device))

    @classmethod
    def of(cls, model) -> "Runtime":
        """The default for a model used outside a run: a single process at float32 on the
        model's device."""
        return cls(next(model.parameters()).device)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the forwards compute in: what autocast casts to, what FSDP2 gathers weights
        in, what the vLLM engine loads."""
        return torch.bfloat16 if self.bf16 else torch.float32

    def autocast(self):
        """The forwards' precision: bf16 autocast on this device, or a no-op context (fp32)."""
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def log(self, precision: str, role: str = "trainer") -> None:
        """One line (logger ``grpo_fast``, rank 0) saying what ``precision`` became here."""
        if self.ranks.is_main:
            logger.info(
                "%s on %s: --precision %s -> %s for every forward (training, reference, old log-probs, sampler, "
                "hf, vllm)",
                role,
                self.device,
                precision,
                "bf16" if self.bf16 else "fp32",
            )

    def flash_attention(self) -> bool:
        """Whether a model here can attend with ``flash_attention_2``: CUDA, bf16 forwards and
        the flash-attn package installed."""
        from transformers.utils import is_flash_attn_2_available

        return self.device.type == "cuda" and self.bf16 and is_flash_attn_2_available()
