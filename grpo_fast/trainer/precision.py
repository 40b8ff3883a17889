"""The precision of a run's forward passes: bf16 autocast over float32 weights, or float32.

Weights, gradients and optimizer states stay float32 either way; under bf16 the matmuls of
every forward (generation, the packed training and reference passes, the PPO critic) run
in bf16 through ``torch.autocast`` (whether a run does: ``GRPOConfig.bf16``).
"""

import contextlib

import torch


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on CUDA when asked; a no-op context otherwise."""
    if bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
