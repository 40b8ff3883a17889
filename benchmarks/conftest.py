"""pytest-benchmark suite of the ops: ``pytest benchmarks/ --benchmark-only``.

Options: ``--bench-device cpu|cuda`` (default: cuda when available) and ``--bench-shape
tiny|full`` (tiny: seconds, for CI; full: the shapes of benchmarks/bench_ops.py on CPU,
16384 tokens x 151936 on CUDA). Save the JSON with ``--benchmark-json PATH``.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (B, T, V) of the loss and log-prob groups, per device and size.
SHAPES = {
    ("cpu", "tiny"): (2, 16, 1000),
    ("cpu", "full"): (8, 512, 32768),
    ("cuda", "tiny"): (2, 16, 1000),
    ("cuda", "full"): (16, 1024, 151936),
}


def pytest_addoption(parser):
    group = parser.getgroup("grpo_fast benchmarks")
    group.addoption("--bench-device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    group.addoption("--bench-shape", choices=("tiny", "full"), default="full")


@pytest.fixture(scope="session")
def device(request):
    import torch

    chosen = request.config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if chosen == "cuda" and not torch.cuda.is_available():
        pytest.skip("--bench-device cuda, but no CUDA device")
    return chosen


@pytest.fixture(scope="session")
def shape(request, device):
    return SHAPES[device, request.config.getoption("--bench-shape")]
