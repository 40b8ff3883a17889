"""Test setup: Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at the
top of the first module pytest loads. ``GRPO_FAST_TEST_CUDA=1`` keeps real CUDA kernels.
"""

import os

if os.environ.get("GRPO_FAST_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("inf")
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num
