"""The op benchmarks as a pytest-benchmark suite: one group per op, dtype and shape, each
holding every implementation of benchmarks/baselines.py (``plain`` is the baseline).

    pytest benchmarks/ --benchmark-only --benchmark-json ops.json                  # CPU or CUDA
    pytest benchmarks/ --benchmark-only --bench-shape tiny --benchmark-min-rounds 1  # seconds

Each implementation runs once untimed first (torch.compile compiles, Triton JITs); on CUDA
every timed call ends with a synchronize, so the time is the device's.
"""

import pytest
import torch
from baselines import LOGPROB_IMPLS, LOSS_IMPLS, logprobs_step, loss_step, make_batch

import grpo_fast
from grpo_fast import reference


def timed(step, device):
    def run():
        step()
        if device == "cuda":
            torch.cuda.synchronize()

    run()  # warm-up: compilation stays out of the numbers
    return run


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_loss_fwd_bwd(benchmark, device, shape, dtype, impl):
    B, T, V = shape
    step = loss_step(impl, make_batch(B, T, V, getattr(torch, dtype), device))
    if step is None:
        pytest.skip(f"{impl} is not available here (Liger-Kernel's GRPO loss: CUDA and liger_kernel installed)")
    benchmark.group = f"loss fwd+bwd {dtype} {B * T}x{V} {device}"
    benchmark.extra_info.update(impl=impl, tokens=B * T, V=V, dtype=dtype, device=device)
    benchmark(timed(step, device))


@pytest.mark.parametrize("impl", LOGPROB_IMPLS)
def test_logprobs_no_grad(benchmark, device, shape, impl):
    B, T, V = shape
    step = logprobs_step(impl, make_batch(B, T, V, torch.bfloat16, device))
    benchmark.group = f"log-probs no-grad bfloat16 {B * T}x{V} {device}"
    benchmark.extra_info.update(impl=impl, tokens=B * T, V=V, dtype="bfloat16", device=device)
    benchmark(timed(step, device))


def _plain_group_advantages(rewards, G):
    grouped = rewards.view(-1, G)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


@pytest.mark.parametrize("impl", ["fused", "plain", "reference"])
def test_group_advantages(benchmark, device, impl):
    G, rewards = 16, torch.rand(4096, device=device)
    fn = dict(
        fused=lambda: grpo_fast.group_advantages(rewards, G),
        plain=lambda: _plain_group_advantages(rewards, G),
        reference=lambda: reference.group_advantages(rewards, G),
    )[impl]
    benchmark.group = f"group_advantages 4096 rewards, G={G} {device}"
    benchmark.extra_info.update(impl=impl, device=device)
    benchmark(timed(fn, device))
