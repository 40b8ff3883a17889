"""GPU check and benchmark of fused_linear_grpo_loss (the LM head and the GRPO loss, chunked).

1. checks loss and gradients (hidden, weight, bias) against the reference on float32
   materialised logits, bf16 inputs, token-level and sequence-level (GSPO) ratios;
2. measures the bf16 matmul rate of the device on the step's own matmul shapes;
3. times a forward + backward (gradients of hidden and weight) at N = 16384 tokens,
   H = 4096, V = 151936, bf16, median of timed repeats after a warm-up: ours, and on
   materialised logits the plain recipe (float32 log_softmax + gather + the loss formula),
   torch.compile of it and the eager reference, and Liger-Kernel's LigerFusedLinearGRPOLoss
   if installed;
4. reports TFLOP/s and its fraction of the matmul rate, and the peak memory each step
   adds on top of its inputs (torch.cuda.max_memory_allocated);
5. writes JSON to --out.

FLOPs: the token-level step does three [N, H] x [H, V]-sized matmuls, 6 N H V (logits, then
the two gradients in the same sweep); GSPO recomputes the logits, 8 N H V. The JSON gives
TFLOP/s by the work done and, for comparison with the issue's convention (recompute
counted), by 8 N H V.

    python benchmarks/gpu/bench_fused_linear.py --out $OUT/fused_linear_gpu.json    # about 2 min on an H200
    python benchmarks/gpu/bench_fused_linear.py --dry-run --out /tmp/fl.json         # CPU, tiny shapes
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
ARGS.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "fused_linear_gpu.json"))
ARGS.add_argument("--repeats", type=int, default=5, help="timed repeats after one warm-up (dry run: 1)")
ARGS = ARGS.parse_args()
ARGS.repeats = 1 if ARGS.dry_run else ARGS.repeats
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["GRPO_FAST_BACKEND"] = "triton" if ARGS.dry_run else os.environ.get("GRPO_FAST_BACKEND", "auto")

import torch  # noqa: E402

import grpo_fast  # noqa: E402
from grpo_fast import reference  # noqa: E402
from grpo_fast.bench.measure import cuda_peak_extra_bytes, rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_fused_linear import LOSS, forward_fn, make_batch  # noqa: E402  (the CPU benchmark's batch)

DEVICE = "cpu" if ARGS.dry_run else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device: run with --dry-run for the CPU check of the code paths")
DTYPE = torch.bfloat16
CHECK_SHAPE = (48, 32, 1000, 16) if ARGS.dry_run else (2048, 4096, 151936, 1024)  # N, H, V, tokens per sequence
BENCH_SHAPE = (64, 32, 1000, 16) if ARGS.dry_run else (16384, 4096, 151936, 1024)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench(fn, repeats=ARGS.repeats):
    """Median, min and max of fn's wall time in ms over ``repeats`` calls after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return dict(median_ms=statistics.median(samples), min_ms=min(samples), max_ms=max(samples))


def loss_args(batch):
    return batch["ids"], batch["advantages"], batch["mask"], batch["old"], batch["ref"]


def check(importance_sampling):
    """Relative errors of loss and gradients vs the reference on the same bf16 inputs, upcast."""
    N, H, V, seq_len = CHECK_SHAPE
    batch = make_batch(N, H, V, DTYPE, DEVICE, seq_len)
    bias = (torch.randn(V, device=DEVICE) * 0.1).to(DTYPE).requires_grad_()
    inputs = (batch["hidden"], batch["weight"], bias)
    options = dict(LOSS, importance_sampling=importance_sampling)
    out = grpo_fast.fused_linear_grpo_loss(inputs[0], inputs[1], *loss_args(batch), bias=bias, **options)
    grads = torch.autograd.grad(out.loss, inputs)
    upcast = [x.detach().float().requires_grad_() for x in inputs]
    want = reference.grpo_loss(upcast[0] @ upcast[1].T + upcast[2], *loss_args(batch), **options)
    want_grads = torch.autograd.grad(want.loss, upcast)
    errors = dict(loss=rel_err(out.loss, want.loss))
    errors.update(
        {f"grad_{name}": rel_err(g, w) for name, g, w in zip(("hidden", "weight", "bias"), grads, want_grads)}
    )
    return dict(
        check=f"fused_linear_grpo_loss {importance_sampling}",
        N=N,
        H=H,
        V=V,
        dtype="bfloat16",
        passed=all(e < 1e-2 for e in errors.values()),
        **errors,
    )


def matmul_rates(N, H, V):
    """bf16 TFLOP/s of the step's three matmul shapes, each timed alone, and their total time."""
    a, w, g = (torch.randn(*s, device=DEVICE, dtype=DTYPE) for s in ((N, H), (V, H), (N, V)))
    shapes = dict(logits=lambda: a @ w.T, grad_hidden=lambda: g @ w, grad_weight=lambda: g.T @ a)
    times = {name: bench(fn)["median_ms"] for name, fn in shapes.items()}
    flops = 2 * N * H * V
    return dict(
        tflops={name: flops / (ms * 1e-3) / 1e12 for name, ms in times.items()},
        three_matmuls_ms=sum(times.values()),
        rate_tflops=3 * flops / (sum(times.values()) * 1e-3) / 1e12,
    )


def steps(batch):
    """fwd + bwd closures of each implementation (gradients of hidden and weight)."""
    h, w = batch["hidden"], batch["weight"]

    def run(loss):
        torch.autograd.grad(loss, (h, w))

    def backward_of(impl):  # the CPU benchmark's forward of impl, then the gradients
        forward = forward_fn(impl, batch)
        return lambda: run(forward())

    variants = {
        "fused": backward_of("fused"),
        "fused_gspo": lambda: run(
            grpo_fast.fused_linear_grpo_loss(h, w, *loss_args(batch), importance_sampling="sequence", **LOSS).loss
        ),
    }
    # the materialised-logits baselines, compile's cost last
    variants.update({impl: backward_of(impl) for impl in ("plain", "eager", "compiled")})
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return variants
    liger = LigerFusedLinearGRPOLoss(
        beta=LOSS["beta"],
        epsilon_low=LOSS["eps_low"],
        epsilon_high=LOSS["eps_high"],
        loss_type=LOSS["loss_type"],
        compiled=not ARGS.dry_run,
    )
    ids, adv, mask, old, ref = loss_args(batch)
    variants["liger"] = lambda: run(liger(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0])
    return variants


def device_name():
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU dry run ({platform.processor() or platform.machine()})"


def main():
    report = dict(device=device_name(), torch=torch.__version__, dry_run=ARGS.dry_run, checks=[], timings=[])
    for importance_sampling in ("token", "sequence"):
        try:
            report["checks"].append(check(importance_sampling))
        except Exception:  # keep going: the JSON records what failed and why
            report["checks"].append(dict(check=importance_sampling, passed=False, error=traceback.format_exc()))
        print(json.dumps(report["checks"][-1]), flush=True)

    N, H, V, seq_len = BENCH_SHAPE
    report["shape"] = dict(N=N, H=H, V=V, dtype="bfloat16", loss=LOSS)
    report["matmul"] = matmul_rates(N, H, V)
    print(json.dumps(report["matmul"]), flush=True)
    save(report)
    batch = make_batch(N, H, V, DTYPE, DEVICE, seq_len)
    rate = report["matmul"]["rate_tflops"]
    for name, step in steps(batch).items():
        try:
            row = dict(impl=name, **bench(step), peak_extra_bytes=cuda_peak_extra_bytes(step, DEVICE))
        except Exception as error:  # e.g. eager out of memory
            row = dict(impl=name, error=f"{type(error).__name__}: {error}"[:500])
        else:
            work = (8 if name == "fused_gspo" else 6) * N * H * V
            seconds = row["median_ms"] * 1e-3
            row.update(
                tflops=work / seconds / 1e12,
                fraction_of_matmul_rate=work / seconds / 1e12 / rate,
                tflops_8nhv=8 * N * H * V / seconds / 1e12,
            )
        report["timings"].append(row)
        print(json.dumps(row), flush=True)
        save(report)  # row by row: a stage cut at its budget keeps the rows it timed
    print(f"wrote {ARGS.out}")


def save(report):
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
