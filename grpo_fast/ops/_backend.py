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
# torch.compile") and stays resident: the compiled kernels and their state add 75-85 MiB to
# the process (and importing inductor 143 MiB more where nothing else has), which the eager
# chunks never pay. Below 64M logits (256 MiB in float32) that is as much as the float32
# copies a fused call saves: the trainer's step with the compiled sweep peaked 75 MiB above
# plain eager at the 100m preset of `grpo-fast bench memory` (benchmarks/NOTES.md, issue 40),
# where the eager chunks cost a few milliseconds a call. A 151,936-token vocabulary repays it.
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
