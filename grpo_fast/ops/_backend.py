"""Which implementation runs an op: Triton on CUDA, the chunked torch path on CPU.

``GRPO_FAST_BACKEND=triton|torch|reference`` forces one (tests and benchmarks use it);
it is read at every call, so a test can switch it with ``monkeypatch.setenv``.
"""

import os

import torch

BACKENDS = ("triton", "torch", "reference")


def select_backend(tensor: torch.Tensor) -> str:
    forced = os.environ.get("GRPO_FAST_BACKEND", "").strip().lower()
    if forced in ("", "auto"):
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    if forced not in BACKENDS:
        raise ValueError(f"GRPO_FAST_BACKEND must be one of {BACKENDS} or 'auto', got {forced!r}")
    if forced == "triton" and not triton_available():
        raise RuntimeError("GRPO_FAST_BACKEND=triton but triton is not installed: pip install triton")
    return forced


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
