"""benchmarks/bench_fused_linear.py: every implementation on the CPU (plain, compiled, the spec,
ours) runs its timed repeats on the batch it builds, and they compute the same loss and
gradients (the old and reference log-probs are data, not a graph back to the LM head: a graph
there made eager's second repeat fail)."""

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(REPO, "benchmarks"))  # after tests/: its conftest is not ours
import bench_fused_linear  # noqa: E402


def test_implementations_repeat_and_agree():
    N, H, V = 64, 32, 512
    batch = bench_fused_linear.make_batch(N, H, V, torch.float32)
    assert batch["old"].grad_fn is None and batch["ref"].grad_fn is None
    losses, grads = {}, {}
    for impl in ("plain", "compiled", "eager", "fused"):
        report = bench_fused_linear.worker(dict(impl=impl, N=N, H=H, V=V, dtype="float32", repeats=2, threads=0))
        assert report["repeats"] == 2 and report["median_s"] > 0, report
        loss = bench_fused_linear.forward_fn(impl, batch)()
        assert abs(loss.item() - report["loss"]) < 1e-6  # the worker's batch is this one (seed 0)
        losses[impl] = loss.item()
        grads[impl] = torch.autograd.grad(loss, (batch["hidden"], batch["weight"]))
    for impl in ("plain", "compiled", "fused"):
        assert abs(losses[impl] - losses["eager"]) < 1e-5, impl
        for got, want in zip(grads[impl], grads["eager"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
