"""GPU check and benchmark of the Triton kernels: grpo_loss, token_logprobs, group_advantages.

1. checks every kernel against the float32 reference at real shapes (N = 16384 tokens,
   V = 151936 and 32000, bf16 logits, a strided logits[:, :-1] slice as in training);
2. measures the device's copy bandwidth (the roofline every floor below is divided by);
3. times, with triton.testing.do_bench (median, 20%, 80%), the loss forward + backward and
   the no-grad log-probs: ours (fused; in place; the two-pass path that GSPO takes), the
   eager reference, torch.compile of the reference, Liger-Kernel's Triton GRPO loss;
4. reports GB/s and the fraction of the floor (loss: read the bf16 logits once and write
   the bf16 gradient once, 4 bytes per element; log-probs: read once, 2 bytes) and the peak
   memory each call adds on top of its inputs;
5. writes JSON to $OUT (or --out).

    python benchmarks/gpu/bench_kernels.py             # CUDA, about 3-6 minutes on an H200
    python benchmarks/gpu/bench_kernels.py --dry-run   # CPU, tiny shapes, Triton interpreter

The dry run executes the same code paths (checks, timings, JSON) on CPU; only the timer
(perf_counter instead of do_bench) and the memory counter (none on CPU) differ.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, TRITON_INTERPRET=1")
ARGS.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="folder for the JSON")
ARGS.add_argument("--budget-s", type=float, default=400.0, help="skip optional timings past this many seconds")
ARGS = ARGS.parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["GRPO_FAST_BACKEND"] = "triton"

import torch  # noqa: E402
import triton  # noqa: E402

import grpo_fast  # noqa: E402
from grpo_fast import reference  # noqa: E402
from grpo_fast.bench.measure import cuda_peak_extra_bytes, rel_err  # noqa: E402

START = time.perf_counter()
DEVICE = "cpu" if ARGS.dry_run else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device: run with --dry-run for the CPU check of the code paths")
SHAPES = [(2, 8, 300), (2, 8, 37)] if ARGS.dry_run else [(16, 1024, 151936), (16, 1024, 32000)]  # B, T, V
LOSS_OPTIONS = dict(beta=0.04, eps_low=0.2, eps_high=0.2, loss_type="grpo")
METRICS = ("kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "ratio_mean")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench(fn):
    """Median, 20% and 80% quantiles of fn's time in ms, after warm-up (the first call compiles)."""
    fn()
    sync()
    if DEVICE == "cuda":
        median, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
    else:
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        median, p20, p80 = statistics.median(samples), min(samples), max(samples)
    return dict(median_ms=median, p20_ms=p20, p80_ms=p80)


def copy_bandwidth_gbps():
    """Device copy bandwidth: read + write of a buffer far larger than L2."""
    n = (1 << 20) if ARGS.dry_run else (1 << 30)  # bf16 elements: 2 MiB / 2 GiB
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (t["median_ms"] * 1e-3) / 1e9


def make_batch(B, T, V, *, ragged):
    """bf16 logits [B, T + 1, V] (the loss reads the strided slice [:, :-1]), ids, per-sequence
    advantages of both signs, old/ref log-probs whose ratios cross both clip bounds, and a
    mask: ragged lengths for the checks, all ones for timing (every token is swept)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    full = (torch.randn(B, T + 1, V, device=DEVICE, generator=g) * 2).to(torch.bfloat16)
    ids = torch.randint(0, V, (B, T), device=DEVICE, generator=g)
    with torch.no_grad():
        logp = grpo_fast.token_logprobs(full[:, :-1], ids)
    old = logp + 0.3 * torch.randn(B, T, device=DEVICE, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, device=DEVICE, generator=g)
    adv = torch.randn(B, device=DEVICE, generator=g)
    mask = torch.ones(B, T, device=DEVICE)
    if ragged:
        lengths = torch.randint(T // 2, T + 1, (B,), device=DEVICE, generator=g)
        mask = (torch.arange(T, device=DEVICE) < lengths[:, None]).float()
    return dict(full=full, ids=ids, advantages=adv, mask=mask, old_logprobs=old, ref_logprobs=ref)


def loss_args(batch):
    return batch["ids"], batch["advantages"], batch["mask"], batch["old_logprobs"], batch["ref_logprobs"]


def check_loss(batch, importance_sampling):
    """Ours vs the float32 reference on the same bf16 values: loss, gradient, metrics."""
    logits = batch["full"][:, :-1].detach().requires_grad_()
    out = grpo_fast.grpo_loss(logits, *loss_args(batch), importance_sampling=importance_sampling, **LOSS_OPTIONS)
    (grad,) = torch.autograd.grad(out.loss, logits)
    ref_logits = batch["full"][:, :-1].float().requires_grad_()
    want = reference.grpo_loss(ref_logits, *loss_args(batch), importance_sampling=importance_sampling, **LOSS_OPTIONS)
    (want_grad,) = torch.autograd.grad(want.loss, ref_logits)
    errors = dict(loss=rel_err(out.loss, want.loss), abs_loss=abs(out.loss.item() - want.loss.item()),
                  grad=rel_err(grad, want_grad))  # fmt: skip
    del ref_logits, want_grad
    errors.update({f"abs_{m}": abs(getattr(out, m).item() - getattr(want, m).item()) for m in METRICS})
    # A loss near 0 (advantages of both signs cancel) is checked in absolute terms; a metric
    # may differ by one token (1 / 12000) flipping across a clip bound.
    loss_ok = errors["loss"] < 1e-4 or errors["abs_loss"] < 1e-6
    ok = loss_ok and errors["grad"] < 1e-2 and all(errors[f"abs_{m}"] < 1e-4 for m in METRICS)
    return dict(ok=ok, grad_dtype=str(grad.dtype), **errors)


def check_logprobs(batch):
    """No-grad log-probs and entropy vs the float32 reference."""
    logits = batch["full"][:, :-1]
    with torch.no_grad():
        logp, entropy = grpo_fast.token_logprobs(logits, batch["ids"], temperature=0.9, return_entropy=True)
        want, want_entropy = reference.token_logprobs(logits.float(), batch["ids"], temperature=0.9, return_entropy=True)
    errors = dict(logp=rel_err(logp, want), entropy=rel_err(entropy, want_entropy))
    return dict(ok=max(errors.values()) < 1e-5 and bool((logp <= 0).all()), **errors)


def check_group_advantages(N, G=16):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    rewards = (torch.rand(N, 3, device=DEVICE, generator=g) > 0.5).float()
    rewards[::7, 2] = float("nan")
    weights = torch.tensor([1.0, 0.5, 0.25], device=DEVICE)
    result = {}
    for scale in ("group", "batch", "none"):
        got = grpo_fast.group_advantages(rewards, G, scale=scale, reward_weights=weights)
        want = reference.group_advantages(rewards, G, scale=scale, reward_weights=weights)
        result[scale] = max(rel_err(a, b) if b.norm() > 0 else float((a - b).abs().max()) for a, b in zip(got, want))
    return dict(ok=max(result.values()) < 1e-5, **result)


def liger_loss():
    """Liger-Kernel's Triton GRPO loss (reduce=True: loss, metrics), or None when not importable."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return None
    return triton_grpo_loss


def time_variants(batch, N, V):
    """Every timed variant of one shape: median/p20/p80 ms, GB/s, fraction of floor, peak extra."""
    bw = RESULTS["copy_bandwidth_GBps"] * 1e9
    loss_bytes = N * V * (2 + 2)  # read bf16 logits once + write the bf16 gradient once
    logprob_bytes = N * V * 2  # read once
    full, args = batch["full"], loss_args(batch)
    compiled, compiled_logprobs = torch.compile(reference.grpo_loss), torch.compile(reference.token_logprobs)
    liger = liger_loss()

    def loss_step(fn, inplace=False, **extra):
        def run():
            x = full[:, :-1].detach().requires_grad_()
            out = fn(x, *args, **LOSS_OPTIONS, **extra)
            torch.autograd.grad(out.loss if hasattr(out, "loss") else out[0], x)

        return run

    def ours_inplace():
        x = full[:, :-1].detach().requires_grad_()
        out = grpo_fast.grpo_loss(x, *args, inplace_backward=True, **LOSS_OPTIONS)
        torch.autograd.grad(out.loss, x)  # the logits become the gradient: values change, cost does not

    def liger_step():
        x = full.detach().requires_grad_()  # Liger takes [B, T + 1, V] and drops the last position
        ids, adv, mask, old, ref = args
        loss, _ = liger(x, old, ref, ids, adv, mask, temperature=1.0, beta=LOSS_OPTIONS["beta"], eps_low=0.2,
                        eps_high=0.2, inplace=True, loss_type="grpo", reduce=True)  # fmt: skip
        torch.autograd.grad(loss, x)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn(full[:, :-1], batch["ids"])

        return run

    variants = [
        ("loss fwd+bwd", "ours (fused)", loss_step(grpo_fast.grpo_loss), loss_bytes),
        ("loss fwd+bwd", "ours (fused, in-place grad)", ours_inplace, loss_bytes),
        ("loss fwd+bwd", "ours (two-pass, GSPO path)", loss_step(grpo_fast.grpo_loss, importance_sampling="sequence"),
         loss_bytes),
        ("loss fwd+bwd", "eager reference", loss_step(reference.grpo_loss), loss_bytes),
        ("loss fwd+bwd", "torch.compile(reference)", loss_step(compiled), loss_bytes),
        ("loss fwd+bwd", "Liger-Kernel triton_grpo_loss (in-place)", None if liger is None else liger_step, loss_bytes),
        ("log-probs no-grad", "ours", no_grad(grpo_fast.token_logprobs), logprob_bytes),
        ("log-probs no-grad", "eager reference", no_grad(reference.token_logprobs), logprob_bytes),
        ("log-probs no-grad", "torch.compile(reference)", no_grad(compiled_logprobs), logprob_bytes),
    ]  # fmt: skip
    rows = []
    for op, impl, fn, floor_bytes in variants:
        row = dict(op=op, impl=impl, N=N, V=V, floor_bytes=floor_bytes)
        if fn is None:
            row["skipped"] = "not importable"
        elif time.perf_counter() - START > ARGS.budget_s and not impl.startswith("ours"):
            row["skipped"] = f"time budget of {ARGS.budget_s:.0f} s spent"
        else:
            try:
                t = bench(fn)
                row.update(t, GBps=floor_bytes / (t["median_ms"] * 1e-3) / 1e9,
                           fraction_of_floor=floor_bytes / bw / (t["median_ms"] * 1e-3),
                           peak_extra_bytes=cuda_peak_extra_bytes(fn, DEVICE))  # fmt: skip
            except Exception as e:  # a competitor failing must not hide the other rows
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    for op, base in (("loss fwd+bwd", "ours (fused, in-place grad)"), ("log-probs no-grad", "ours")):
        ours = next(r for r in rows if r["op"] == op and r["impl"] == base)
        for r in rows:
            if r["op"] == op and "median_ms" in r and "median_ms" in ours:
                r[f"speedup_of_{base}"] = r["median_ms"] / ours["median_ms"]
    return rows


def sweep_fused_configs(batch, N, V):
    """The fused loss (in-place, fwd+bwd) under launch knobs: vocabulary block, warps, and
    programs = rows in flight (each program loops over rows; fewer rows in flight keep the
    second sweep of each row in L2). Defaults: one program per row, block 4096, 8 warps."""
    from grpo_fast.ops.grpo_loss import fused_grpo_loss

    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 2
    configs = [(4096, 8, None), (4096, 8, sms), (4096, 8, 2 * sms), (4096, 8, 4 * sms), (8192, 16, sms),
               (8192, 8, 2 * sms), (16384, 16, sms), (2048, 4, 4 * sms)]  # fmt: skip
    bw = RESULTS["copy_bandwidth_GBps"] * 1e9
    floor_bytes = N * V * 4
    rows = []
    for block_v, warps, programs in configs:
        def step():
            x = batch["full"][:, :-1].detach().requires_grad_()
            out = fused_grpo_loss(x, *loss_args(batch), inplace_backward=True, block_v=block_v, warps=warps,
                                   programs=programs, importance_sampling="token", **LOSS_OPTIONS)  # fmt: skip
            torch.autograd.grad(out.loss, x)

        t = bench(step)
        rows.append(dict(V=V, N=N, block_v=block_v, warps=warps, programs=programs or N, **t,
                         fraction_of_floor=floor_bytes / bw / (t["median_ms"] * 1e-3)))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def device_name():
    return torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU dry run ({platform.processor() or 'cpu'})"


RESULTS = dict(
    device=device_name(),
    dry_run=ARGS.dry_run,
    torch=torch.__version__,
    triton=triton.__version__,
    shapes=[dict(B=B, T=T, N=B * T, V=V, dtype="bfloat16") for B, T, V in SHAPES],
)


def main():
    RESULTS["copy_bandwidth_GBps"] = copy_bandwidth_gbps()
    print(f"{RESULTS['device']}: copy bandwidth {RESULTS['copy_bandwidth_GBps']:.0f} GB/s", flush=True)
    checks, timings, sweep = [], [], []
    for B, T, V in SHAPES:
        N = B * T
        batch = make_batch(B, T, V, ragged=True)
        for name, fn in (
            ("grpo_loss token-level (fused kernel)", lambda: check_loss(batch, "token")),
            ("grpo_loss sequence-level (logprobs fwd/bwd kernels)", lambda: check_loss(batch, "sequence")),
            ("token_logprobs no-grad + entropy", lambda: check_logprobs(batch)),
        ):
            checks.append(dict(check=name, N=N, V=V, **fn()))
            print(json.dumps(checks[-1]), flush=True)
        del batch
        timing_batch = make_batch(B, T, V, ragged=False)
        timings += time_variants(timing_batch, N, V)
        if time.perf_counter() - START < ARGS.budget_s:
            sweep += sweep_fused_configs(timing_batch, N, V)
        del timing_batch
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    checks.append(dict(check="group_advantages (3 scales, weighted NaN columns)", N=SHAPES[0][0] * SHAPES[0][1],
                       **check_group_advantages(SHAPES[0][0] * SHAPES[0][1])))  # fmt: skip
    print(json.dumps(checks[-1]), flush=True)
    RESULTS.update(checks=checks, timings=timings, fused_loss_config_sweep=sweep, all_checks_ok=all(c["ok"] for c in checks),
                   elapsed_s=time.perf_counter() - START)  # fmt: skip
    os.makedirs(ARGS.out, exist_ok=True)
    slug = "dryrun_cpu" if ARGS.dry_run else "".join(c if c.isalnum() else "_" for c in RESULTS["device"]).strip("_")
    path = os.path.join(ARGS.out, f"kernels_{slug}.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)
    print_table(timings)
    for V in sorted({r["V"] for r in sweep}):
        best = min((r for r in sweep if r["V"] == V), key=lambda r: r["median_ms"])
        print(f"best fused-loss launch at V={V}: block {best['block_v']}, {best['warps']} warps, "
              f"{best['programs']} programs: {best['median_ms']:.3f} ms, {best['fraction_of_floor']:.0%} of floor")
    print(f"checks {'all passed' if RESULTS['all_checks_ok'] else 'FAILED'}; wrote {path} "
          f"in {RESULTS['elapsed_s']:.0f} s")  # fmt: skip
    return 0 if RESULTS["all_checks_ok"] else 1


def print_table(rows):
    print(f"\n{RESULTS['device']}, bf16, copy bandwidth {RESULTS['copy_bandwidth_GBps']:.0f} GB/s\n")
    print("| op | V | implementation | median ms (p20-p80) | GB/s | of floor | peak extra MiB | time / ours |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "median_ms" not in r:
            print(f"| {r['op']} | {r['V']} | {r['impl']} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        mem = "n/a" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.0f}"
        speed = next((v for k, v in r.items() if k.startswith("speedup_of")), None)
        print(f"| {r['op']} | {r['V']} | {r['impl']} | {r['median_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f}) | "
              f"{r['GBps']:.0f} | {r['fraction_of_floor']:.0%} | {mem} | "
              f"{'' if speed is None else f'{speed:.2f}x'} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
