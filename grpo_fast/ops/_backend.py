"""Which implementation runs an op: Triton on CUDA, the chunked torch path on CPU.

``GRPO_FAST_BACKEND=triton|torch|reference`` forces one (tests and benchmarks use it);
it is read at every call, so a test can switch it with ``monkeypatch.setenv``.

On CPU the torch path's vocabulary sweep (``ops/token_logprobs.py``) runs as kernels that
inductor generates from our own row math when the logits are large enough to repay a
compile (``COMPILE_MIN_ELEMENTS``), else as eager chunks. ``GRPO_FAST_CPU_COMPILE=1`` compiles
whatever the size, ``0`` never.
"""

import os

import torch

BACKENDS = ("triton", "torch", "reference")

# A compile costs 2-5 s once per process and dtype (benchmarks/NOTES.md, "The CPU loss against
# torch.compile") and stays resident: importing inductor and the first compiled kernels add
# about 230 MiB to the process (143 + 84 MiB measured on CPU), which the eager chunks never
# pay. Below 64M logits (256 MiB in float32) that is as much as the float32 copies a fused
# call saves, so a step with the compiled sweep peaked above plain eager (the 100m preset of
# `grpo-fast bench memory`: +75 MiB; NOTES, "Fused above eager"); the eager chunks there
# cost a few milliseconds a call. Larger calls, such as a 151,936-token vocabulary's, repay it.
COMPILE_MIN_ELEMENTS = 1 << 26


def select_backend(tensor: torch.Tensor) -> str:
    forced = os.environ.get("GRPO_FAST_BACKEND", "").strip().lower()
    if forced in ("", "auto"):
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    if forced not in BACKENDS:
        raise ValueError(f"GRPO_FAST_BACKEND must be one of {BACKENDS} or 'auto', got {forced!r}")
    if forced == "triton" and not triton_available():
        raise RuntimeError("GRPO_FAST_BACKEND=triton but triton is not installed: pip install triton")
    return forced


def cpu_compile(tensor: torch.Tensor) -> bool:
    """Whether the torch path runs its vocabulary sweep over ``tensor`` as inductor kernels."""
    forced = os.environ.get("GRPO_FAST_CPU_COMPILE", "").strip().lower()
    if forced not in ("", "auto", "0", "1"):
        raise ValueError(f"GRPO_FAST_CPU_COMPILE must be 0, 1 or 'auto', got {forced!r}")
    if tensor.device.type != "cpu" or forced == "0":
        return False
    return forced == "1" or tensor.numel() >= COMPILE_MIN_ELEMENTS


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
