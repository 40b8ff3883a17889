"""GPU check and benchmark of the Triton kernels, in three stages (run_all.sh gives each its
own time budget and runs them in this order):

  check  every kernel against the reference on CUDA, bf16 and fp32 logits: every loss type,
         the KL estimators, bias-corrected KL, temperature, entropy, GSPO (the two-pass path),
         a strided [:, :-1] slice and a transposed view, in-place gradient: loss, metrics and
         dL/dlogits; token_logprobs forward and backward; group_advantages. Then the
         registers and spills of every kernel the checks compiled (the device's own build).
  time   copy bandwidth; loss forward + backward and no-grad log-probs of every
         implementation in benchmarks/baselines.py (ours, plain eager, TRL's path,
         torch.compile, Liger-Kernel, the reference) at N = 16384 tokens, V = 151936 and
         32000, bf16: median (p20, p80) ms, GB/s, fraction of the floor, peak extra memory
         and the ratio to plain eager.
  sweep  the launch knobs around the bytes-in-flight model's prediction (benchmarks/NOTES.md,
         "Occupancy and bytes in flight"): loss BLOCK_V x warps x programs, log-prob BLOCK_V;
         and a read probe that measures bandwidth against bytes in flight per SM, which gives
         the loaded memory latency the model assumes.

Each stage writes ``<out>/kernels_<stage>.json`` after every row, so a stage cut by its
budget keeps what it measured.

    python3 benchmarks/gpu/bench_kernels.py --stage check              # CUDA
    python3 benchmarks/gpu/bench_kernels.py --stage time --dry-run     # CPU, tiny shapes, interpreter

Floors (bytes that must move, over the measured copy rate): the loss reads the logits once
and writes their gradient once (4 B per element for bf16, 8 for fp32); no-grad log-probs
read them once (2 B per bf16 element).
"""

import argparse
import json
import os
import platform
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--stage", choices=("check", "time", "sweep"), required=True)
ARGS.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, TRITON_INTERPRET=1")
ARGS.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="folder for the JSON")
ARGS.add_argument("--budget-s", type=float, default=1e9, help="start no new row after this many seconds")
ARGS = ARGS.parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["GRPO_FAST_BACKEND"] = "triton"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import grpo_fast  # noqa: E402
from grpo_fast import reference  # noqa: E402
from grpo_fast.bench.measure import cuda_peak_extra_bytes, rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from baselines import BETA, EPS, LOGPROB_IMPLS, LOSS_IMPLS, logprobs_step, loss_step, make_batch  # noqa: E402

START = time.perf_counter()
DEVICE = "cpu" if ARGS.dry_run else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device: run with --dry-run for the CPU check of the code paths")
SMS = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 2
CHECK_SHAPES = [(2, 8, 300), (2, 5, 37)] if ARGS.dry_run else [(8, 256, 32000), (4, 128, 151936)]  # B, T, V
TIME_SHAPES = [(2, 8, 300)] if ARGS.dry_run else [(16, 1024, 151936), (16, 1024, 32000)]
METRICS = ("kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "ratio_mean", "entropy")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench(fn):
    """Median, 20% and 80% quantiles of fn's time in ms, after a warm-up call (which compiles)."""
    fn()
    sync()
    if DEVICE == "cuda":
        median, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        return dict(median_ms=median, p20_ms=p20, p80_ms=p80)
    start = time.perf_counter()  # the dry run on CPU: one call proves the code path, its time means nothing
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return dict(median_ms=ms, p20_ms=ms, p80_ms=ms)


def over_budget() -> bool:
    return time.perf_counter() - START > ARGS.budget_s


class Report:
    """The stage's JSON, rewritten after every row."""

    def __init__(self, stage):
        name = torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU dry run ({platform.machine()})"
        self.path = os.path.join(ARGS.out, f"kernels_{stage}{'_dryrun' if ARGS.dry_run else ''}.json")
        self.data = dict(
            stage=stage,
            device=name,
            dry_run=ARGS.dry_run,
            torch=torch.__version__,
            triton=triton.__version__,
            sms=SMS,
            date=time.strftime("%Y-%m-%d"),
        )
        os.makedirs(ARGS.out, exist_ok=True)

    def add(self, section, row):
        self.data.setdefault(section, []).append(row)
        print(json.dumps(row), flush=True)
        self.save()

    def save(self):
        self.data["elapsed_s"] = time.perf_counter() - START
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)


# ---------------------------------------------------------------- check


def check_cases(T):
    """(name, loss keywords, logits dtype, layout): every loss type and the options that change the kernel's math."""
    from grpo_fast.spec import LOSS_TYPES

    needs = dict(max_completion_length=T)
    cases = []
    for dtype in ("bfloat16", "float32"):
        for loss_type, kind in LOSS_TYPES.items():
            options = dict(loss_type=loss_type, **{k: needs[k] for k in kind.requires})
            cases.append((f"{loss_type}", options, dtype, "slice"))
        cases += [
            ("grpo GSPO (two-pass path)", dict(importance_sampling="sequence"), dtype, "slice"),
            ("grpo kl k1, temperature 0.7", dict(kl_estimator="k1", temperature=0.7), dtype, "slice"),
            ("grpo kl k2, bias-corrected", dict(kl_estimator="k2", kl_bias_correction=True), dtype, "slice"),
            ("grpo transposed logits (stride_v != 1)", {}, dtype, "transposed"),
            ("grpo in-place gradient", dict(inplace=True), dtype, "slice"),
        ]
    return cases


def logits_in_layout(full, layout):
    """The [B, T, V] view the loss reads: a [:, :-1] slice, or a transposed copy (stride_v = T)."""
    x = full[:, :-1]
    return x if layout == "slice" else x.transpose(1, 2).contiguous().transpose(1, 2)


def check_loss(B, T, V, name, options, dtype, layout):
    """Ours vs the reference on the same values (bf16 upcast): loss, dL/dlogits, every metric."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    full = (torch.randn(B, T + 1, V, device=DEVICE, generator=g) * 2).to(getattr(torch, dtype))
    ids = torch.randint(0, V, (B, T), device=DEVICE, generator=g)
    with torch.no_grad():
        logp = reference.token_logprobs(full[:, :-1].float(), ids)
    old, ref = (
        logp + 0.3 * torch.randn(B, T, device=DEVICE, generator=g),
        logp + 0.3 * torch.randn(B, T, device=DEVICE, generator=g),
    )
    adv = torch.randn(B, device=DEVICE, generator=g)
    lengths = torch.randint(1, T + 1, (B,), device=DEVICE, generator=g)
    mask = (torch.arange(T, device=DEVICE) < lengths[:, None]).float()
    options = dict(options, beta=BETA, eps_low=EPS)
    inplace = options.pop("inplace", False)
    args = (ids, adv, mask, old, ref)
    want_logits = full[:, :-1].float().requires_grad_()
    want = reference.grpo_loss(want_logits, *args, return_entropy=True, **options)
    (want_grad,) = torch.autograd.grad(want.loss, want_logits)
    x = logits_in_layout(full, layout).detach().requires_grad_()
    out = grpo_fast.grpo_loss(x, *args, return_entropy=True, inplace_backward=inplace, **options)
    (grad,) = torch.autograd.grad(out.loss, x)
    if inplace:
        assert grad.data_ptr() == x.data_ptr(), "inplace_backward did not write into the logits"
    errors = dict(
        loss=rel_err(out.loss, want.loss),
        abs_loss=abs(out.loss.item() - want.loss.item()),
        grad=rel_err(grad, want_grad),
    )
    errors.update(
        {
            f"abs_{m}": abs(getattr(out, m).item() - getattr(want, m).item())
            for m in METRICS
            if getattr(want, m) is not None
        }
    )
    fp32 = dtype == "float32"
    # A loss near 0 (advantages of both signs cancel) is judged in absolute terms; a clip metric
    # may differ by one token flipping across a bound.
    loss_ok = errors["loss"] < (1e-5 if fp32 else 1e-4) or errors["abs_loss"] < 1e-6
    grad_ok = errors["grad"] < (1e-5 if fp32 else 1e-2)
    metrics_ok = all(v < 1e-3 for k, v in errors.items() if k.startswith("abs_") and k != "abs_loss")
    finite = bool(torch.isfinite(grad).all())
    return dict(
        check=f"grpo_loss {name}", dtype=dtype, N=B * T, V=V, ok=loss_ok and grad_ok and metrics_ok and finite, **errors
    )


def check_logprobs(B, T, V, dtype):
    """token_logprobs forward (log-probs, entropy) and backward vs the reference."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    full = (torch.randn(B, T + 1, V, device=DEVICE, generator=g) * 2).to(getattr(torch, dtype))
    ids = torch.randint(0, V, (B, T), device=DEVICE, generator=g)
    weights = torch.randn(B, T, device=DEVICE, generator=g)
    x = full[:, :-1].detach().requires_grad_()
    logp, entropy = grpo_fast.token_logprobs(x, ids, temperature=0.9, return_entropy=True)
    (grad,) = torch.autograd.grad((logp * weights).sum(), x)
    y = full[:, :-1].float().requires_grad_()
    want, want_entropy = reference.token_logprobs(y, ids, temperature=0.9, return_entropy=True)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), y)
    errors = dict(logp=rel_err(logp, want), entropy=rel_err(entropy, want_entropy), grad=rel_err(grad, want_grad))
    tol = 1e-5 if dtype == "float32" else 1e-2
    ok = errors["logp"] < 1e-5 and errors["entropy"] < 1e-5 and errors["grad"] < tol and bool((logp <= 0).all())
    return dict(check="token_logprobs fwd + bwd, entropy, temperature 0.9", dtype=dtype, N=B * T, V=V, ok=ok, **errors)


def check_group_advantages(N=1024, G=16):
    g = torch.Generator(device=DEVICE).manual_seed(2)
    rewards = (torch.rand(N, 3, device=DEVICE, generator=g) > 0.5).float()
    rewards[::7, 2] = float("nan")
    weights = torch.tensor([1.0, 0.5, 0.25], device=DEVICE)
    errors = {}
    for scale in ("group", "batch", "none"):
        got = grpo_fast.group_advantages(rewards, G, scale=scale, reward_weights=weights)
        want = reference.group_advantages(rewards, G, scale=scale, reward_weights=weights)
        errors[scale] = max(rel_err(a, b) if b.norm() > 0 else float((a - b).abs().max()) for a, b in zip(got, want))
    return dict(check="group_advantages, 3 scales, weighted NaN columns", N=N, ok=max(errors.values()) < 1e-5, **errors)


def compiled_kernels():
    """Registers, spills, warps and shared memory of every kernel variant this process compiled."""
    import grpo_fast.kernels.group_advantages as ga
    import grpo_fast.kernels.grpo_loss as gl
    import grpo_fast.kernels.token_logprobs as tlp

    rows = []
    for module in (gl, tlp, ga):
        for name, fn in vars(module).items():
            for caches in getattr(fn, "device_caches", {}).values() if name.endswith("_kernel") else ():
                for kernel in caches[0].values():
                    constants = getattr(getattr(kernel, "src", None), "constants", {}) or {}
                    rows.append(
                        dict(
                            kernel=name,
                            n_regs=kernel.n_regs,
                            n_spills=kernel.n_spills,
                            num_warps=kernel.metadata.num_warps,
                            shared=kernel.metadata.shared,
                            constants={str(k): str(v) for k, v in constants.items()},
                        )
                    )
    return rows


def stage_check():
    report = Report("check")
    for B, T, V in CHECK_SHAPES:
        for dtype in ("bfloat16", "float32"):
            report.add("checks", _guard(check_logprobs, B, T, V, dtype))
        for name, options, dtype, layout in check_cases(T):
            if over_budget():
                report.add("checks", dict(check=name, ok=False, skipped=f"stage budget of {ARGS.budget_s:.0f} s spent"))
                break
            report.add("checks", _guard(check_loss, B, T, V, name, options, dtype, layout))
    report.add("checks", _guard(check_group_advantages))
    try:
        report.data["compiled_kernels"] = compiled_kernels()  # empty under the interpreter
    except Exception as error:  # Triton's cache layout is internal: a change must not cost the checks
        report.data["compiled_kernels"] = []
        report.data["compiled_kernels_error"] = f"{type(error).__name__}: {error}"
    report.data["all_checks_ok"] = all(c["ok"] for c in report.data["checks"])
    report.save()
    failed = [c["check"] + " " + c.get("dtype", "") for c in report.data["checks"] if not c["ok"]]
    print(f"checks: {len(report.data['checks']) - len(failed)} passed, {len(failed)} failed {failed}")
    for k in report.data["compiled_kernels"]:
        print(f"compiled {k['kernel']}: {k['n_regs']} registers, {k['n_spills']} spills, {k['num_warps']} warps")
    return 0 if not failed else 1


def _guard(fn, *args):
    """A failing check is a row with its error, not the end of the stage."""
    try:
        return fn(*args)
    except Exception as error:
        return dict(check=f"{fn.__name__}{args}", ok=False, error=f"{type(error).__name__}: {str(error)[:500]}")


# ---------------------------------------------------------------- time


def copy_bandwidth_gbps():
    """Device copy rate, read + write counted, over a buffer far larger than L2."""
    n = (1 << 20) if ARGS.dry_run else (1 << 30)  # bf16 elements: 2 MiB / 2 GiB
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (t["median_ms"] * 1e-3) / 1e9


def timed_row(op, impl, step, floor_bytes, bandwidth, **shape):
    row = dict(op=op, impl=impl, floor_bytes=floor_bytes, **shape)
    if step is None:
        return dict(row, skipped="not available here")
    if over_budget():
        return dict(row, skipped=f"stage budget of {ARGS.budget_s:.0f} s spent")
    try:
        t = bench(step)
    except Exception as error:  # a competitor failing must not hide the other rows
        return dict(row, error=f"{type(error).__name__}: {str(error)[:300]}")
    seconds = t["median_ms"] * 1e-3
    return dict(
        row,
        **t,
        GBps=floor_bytes / seconds / 1e9,
        fraction_of_floor=floor_bytes / bandwidth / seconds,
        peak_extra_bytes=cuda_peak_extra_bytes(step, DEVICE),
    )


# (op, implementation) in the order they are timed, every shape before the next pair: ours and
# the baseline first, so that a stage cut by its budget still holds the ratios that matter;
# torch.compile (tens of seconds of compiling per shape) and the slow reference last; the
# in-place variant after every other reader of the logits it overwrites (its cost does not
# depend on their values).
TIME_ORDER = [
    ("loss fwd+bwd", "fused"),
    ("loss fwd+bwd", "plain"),
    ("log-probs no-grad", "fused"),
    ("log-probs no-grad", "plain"),
    ("loss fwd+bwd", "liger"),
    ("loss fwd+bwd", "trl"),
    ("log-probs no-grad", "trl"),
    ("loss fwd+bwd", "fused GSPO (two-pass)"),
    ("loss fwd+bwd", "compiled"),
    ("log-probs no-grad", "compiled"),
    ("loss fwd+bwd", "reference"),
    ("log-probs no-grad", "reference"),
    ("loss fwd+bwd", "fused_inplace"),
]


def stage_time():
    report = Report("time")
    bandwidth = copy_bandwidth_gbps() * 1e9
    report.data["copy_bandwidth_GBps"] = bandwidth / 1e9
    print(f"{report.data['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    assert {i for op, i in TIME_ORDER if op == "loss fwd+bwd"} >= set(LOSS_IMPLS), "an implementation is never timed"
    assert {i for op, i in TIME_ORDER if op == "log-probs no-grad"} >= set(LOGPROB_IMPLS)
    batches = {(B, T, V): make_batch(B, T, V, torch.bfloat16, DEVICE) for B, T, V in TIME_SHAPES}
    for op, impl in TIME_ORDER:
        for (B, T, V), batch in batches.items():
            if impl == "fused GSPO (two-pass)":  # the log-prob kernels + torch
                step = loss_step("fused", batch, importance_sampling="sequence")
            else:
                step = (loss_step if op == "loss fwd+bwd" else logprobs_step)(impl, batch)
            floor = B * T * V * (4 if op == "loss fwd+bwd" else 2)
            report.add("timings", timed_row(op, impl, step, floor, bandwidth, N=B * T, V=V))
    for r in report.data["timings"]:
        plain = next(p for p in report.data["timings"] if (p["op"], p["V"], p["impl"]) == (r["op"], r["V"], "plain"))
        if "median_ms" in r and "median_ms" in plain:
            r["speedup_vs_plain"] = plain["median_ms"] / r["median_ms"]
    report.save()
    print_table(report.data)
    return 0


def print_table(data):
    print(f"\n{data['device']}, bf16 logits, copy bandwidth {data['copy_bandwidth_GBps']:.0f} GB/s\n")
    print(
        "| op | N x V | implementation | median ms (p20-p80) | GB/s | of floor | peak extra MiB | speed-up vs plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in data["timings"]:
        head = f"| {r['op']} | {r['N']} x {r['V']} | {r['impl']} |"
        if "median_ms" not in r:
            print(f"{head} {r.get('skipped') or r.get('error')} | | | | |")
            continue
        mem = "n/a" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.0f}"
        speed = f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else ""
        print(
            f"{head} {r['median_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f}) | {r['GBps']:.0f} | "
            f"{r['fraction_of_floor']:.0%} | {mem} | {speed} |"
        )


# ---------------------------------------------------------------- sweep


@triton.jit
def _read_probe_kernel(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr):
    """Each program sums blocks i, i + programs, ...: one BLOCK of loads in flight per resident CTA."""
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        acc += tl.load(x_ptr + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)  # i * BLOCK < 2^31
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_probe(report):
    """Read bandwidth against bytes in flight per SM: k resident CTAs per SM, BLOCK bf16 each.
    Below saturation, bandwidth = bytes in flight / latency (Little's law)."""
    n = (1 << 16) if ARGS.dry_run else (1 << 30)  # bf16 elements: 128 KiB / 2 GiB, 40x the L2
    x = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty(64 * SMS, device=DEVICE)
    for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8)):
        for per_sm in (1, 2, 4, 8):
            if over_budget():
                return
            programs = per_sm * SMS
            t = bench(lambda: _read_probe_kernel[(programs,)](x, out, n // block, BLOCK=block, num_warps=warps))
            gbps = n * 2 / (t["median_ms"] * 1e-3) / 1e9
            in_flight = per_sm * block * 2
            report.add(
                "read_probe",
                dict(
                    block=block,
                    warps=warps,
                    ctas_per_sm=per_sm,
                    bytes_in_flight_per_sm=in_flight,
                    GBps=gbps,
                    implied_latency_us=in_flight * SMS / (gbps * 1e9) * 1e6,
                    **t,
                ),
            )


def stage_sweep():
    """Around the model's prediction (NOTES.md): the default launch, then each knob moved."""
    from grpo_fast.kernels.token_logprobs import logprobs_bwd, logprobs_fwd

    report = Report("sweep")
    bandwidth = copy_bandwidth_gbps() * 1e9
    report.data["copy_bandwidth_GBps"] = bandwidth / 1e9
    read_probe(report)
    knobs = [(4096, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 16), (8192, 8), (8192, 16), (16384, 16)]
    for B, T, V in TIME_SHAPES:
        N = B * T
        batch = make_batch(B, T, V, torch.bfloat16, DEVICE)
        args = (batch["ids"], batch["advantages"], batch["mask"], batch["old"], batch["ref"])
        for entropy in (True, False):
            for block, warps in knobs[:2] if ARGS.dry_run else knobs:
                for per_sm in (None, 2, 4, 8):
                    programs = None if per_sm is None else per_sm * SMS
                    launch = dict(block_v=block, warps=warps, programs=programs)

                    def step():
                        x = batch["logits"].detach().requires_grad_()
                        out = grpo_fast.grpo_loss(
                            x, *args, beta=BETA, return_entropy=entropy, inplace_backward=True, launch=launch
                        )
                        torch.autograd.grad(out.loss, x)

                    row = timed_row("loss fwd+bwd", "fused in-place", step, N * V * 4, bandwidth, N=N, V=V)
                    row.update(
                        entropy=entropy, programs=programs or N, **{k: v for k, v in launch.items() if k != "programs"}
                    )
                    report.add("loss", row)
        # The backward's inputs do not depend on the block size: one gradient buffer, one forward.
        out = torch.empty_like(batch["logits"])
        lse = logprobs_fwd(batch["logits"], batch["ids"], 1.0, False)[1]
        for block in (1024, 2048, 4096, 8192, 16384):
            for entropy in (False, True):
                fwd = lambda: logprobs_fwd(batch["logits"], batch["ids"], 1.0, entropy, block_v=block)  # noqa: E731
                report.add(
                    "logprobs_fwd",
                    dict(
                        timed_row("log-probs fwd", "fused", fwd, N * V * 2, bandwidth, N=N, V=V),
                        block_v=block,
                        entropy=entropy,
                    ),
                )
            bwd = lambda: logprobs_bwd(batch["logits"], batch["ids"], lse, lse, 1.0, out, block_v=block)  # noqa: E731
            report.add(
                "logprobs_bwd",
                dict(timed_row("log-probs bwd", "fused", bwd, N * V * 4, bandwidth, N=N, V=V), block_v=block),
            )
        batch = out = None  # the next shape's logits need the memory
    for section in ("loss", "logprobs_fwd", "logprobs_bwd"):
        rows = [r for r in report.data.get(section, []) if "median_ms" in r]
        for V in sorted({r["V"] for r in rows}):
            best = min((r for r in rows if r["V"] == V), key=lambda r: r["median_ms"])
            print(f"best {section} at V={V}: {json.dumps({k: best[k] for k in best if k not in ('op', 'impl')})}")
    return 0


if __name__ == "__main__":
    sys.exit(dict(check=stage_check, time=stage_time, sweep=stage_sweep)[ARGS.stage]())
