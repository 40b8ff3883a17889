"""CPU benchmark of the fused ops against what a user would write: fwd+bwd time and peak memory.

Implementations (benchmarks/baselines.py): ``plain`` (float32 log_softmax + gather + the loss
formula, eager: the baseline every ratio is taken against), ``fused`` and ``fused_inplace``
(grpo_fast), ``trl`` (TRL's selective_log_softmax path), ``compiled`` (torch.compile of plain)
and ``reference`` (grpo_fast.reference, the readable spec). Each (case, implementation) runs
in a fresh subprocess to report the growth of its peak RSS during one call, after a warm-up
call that compiles what compiles (``compiled``; ours on CPU above 4M logits); the times come
from one process per case that alternates the implementations round by round (a warm-up
round first), so that a change in the machine's load falls on all of them alike: median
(20%, 80%) of the rounds.

    python benchmarks/bench_ops.py                 # full table, writes benchmarks/results/ops_cpu.json
    python benchmarks/bench_ops.py --quick         # tiny shapes (smoke test)

The same implementations as a pytest-benchmark suite: ``pytest benchmarks/ --benchmark-only``.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
from common import machine_info, peak_rss_growth, print_table, quantiles, run_isolated  # noqa: E402

# (name, B, T, V, dtype): 4096 tokens at a Llama-2-sized vocabulary, 1024 at Qwen's vocabulary.
CASES = [
    ("loss_bf16_32k", 8, 512, 32768, "bfloat16"),
    ("loss_fp32_32k", 8, 512, 32768, "float32"),
    ("loss_bf16_152k", 4, 256, 151936, "bfloat16"),
    ("loss_fp32_152k", 4, 256, 151936, "float32"),
    ("logprobs_nograd_bf16_32k", 8, 512, 32768, "bfloat16"),
]
QUICK_CASES = [(name, 2, 16, 1000, dtype) for name, _, _, _, dtype in CASES]
LOSS_IMPLS = tuple(impl for impl in baselines.LOSS_IMPLS if impl != "liger")  # Liger's kernels need a GPU
LOGPROB_IMPLS = baselines.LOGPROB_IMPLS


def worker(config: dict) -> dict:
    """``mode="memory"``: the peak RSS growth of one call of ``impl`` after a warm-up call
    (a fresh process each).
    ``mode="time"``: every implementation of the case in one process, interleaved: after a
    warm-up call of each, ``repeats`` rounds that time one call of each in turn, so that a
    change in the machine's load falls on all of them alike."""
    import torch

    if config["threads"]:
        torch.set_num_threads(config["threads"])
    batch = baselines.make_batch(config["B"], config["T"], config["V"], getattr(torch, config["dtype"]))
    build = baselines.logprobs_step if config["name"].startswith("logprobs") else baselines.loss_step
    if config["mode"] == "memory":  # a call after a warm-up one: nothing needs the logits after it
        step = build(config["impl"], batch)
        step()  # compiles what compiles (ours, compiled): the peak is the compiled code's, not the compiler's
        return {"peak_bytes": peak_rss_growth(step, reset=True)}
    # fused_inplace writes its gradient into the logits: the others must see the original ones
    pristine = batch["logits"].clone() if "fused_inplace" in config["impls"] else None
    steps = {impl: build(impl, batch) for impl in config["impls"]}
    samples = {impl: [] for impl in steps}
    for round_ in range(1 + config["repeats"]):  # round 0 warms up (and compiles)
        for impl, step in steps.items():
            start = time.perf_counter()
            step()
            if round_:
                samples[impl].append(time.perf_counter() - start)
            if impl == "fused_inplace":
                batch["logits"].copy_(pristine)  # untimed
    return {impl: quantiles(s) for impl, s in samples.items()}


def installed_version(package: str):
    """The installed version, or None (the ``trl`` column then uses baselines.py's rewrite of its path)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (smoke test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "ops_cpu.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    load_at_start = os.getloadavg()  # the run needs an idle machine: its load is recorded
    cases = QUICK_CASES if args.quick else CASES
    repeats = 1 if args.quick else args.repeats
    results, rows = [], []
    for name, B, T, V, dtype in cases:
        impls = LOGPROB_IMPLS if name.startswith("logprobs") else LOSS_IMPLS
        config = dict(name=name, B=B, T=T, V=V, dtype=dtype, repeats=repeats, threads=args.threads)
        times = run_isolated(__file__, dict(config, mode="time", impls=impls))
        by_impl = {}
        for impl in impls:
            memory = run_isolated(__file__, dict(config, mode="memory", impl=impl))
            by_impl[impl] = {**memory, **times.get(impl, {"error": times.get("error", "no timing")})}
            results.append({**config, "impl": impl, **by_impl[impl]})
            print(f"{name} {impl}: {by_impl[impl]}", file=sys.stderr)
        row = {"case": name, "dtype": dtype, "tokens": B * T, "V": V}
        plain = by_impl["plain"]
        for impl, res in by_impl.items():
            if "error" in res:
                row[f"{impl} s"] = "error"
                continue
            row[f"{impl} s"] = f"{res['median_s']:.3f}"
            row[f"{impl} peak MB"] = f"{res['peak_bytes'] / 2**20:.0f}"
            if impl != "plain" and "error" not in plain:
                row[f"{impl} speed-up"] = f"{plain['median_s'] / res['median_s']:.2f}x"
                row[f"{impl} mem ratio"] = f"{res['peak_bytes'] / max(plain['peak_bytes'], 1):.2f}"
        rows.append(row)

    columns = ["case", "dtype", "tokens", "V", "plain s", "fused s"]
    columns += [f"{impl} speed-up" for impl in LOSS_IMPLS[1:]] + ["plain peak MB"]
    columns += [f"{impl} mem ratio" for impl in LOSS_IMPLS[1:]]
    print_table(rows, columns)
    print(
        "\nspeed-up = plain time / its time; mem ratio = its peak RSS growth / plain's. plain = float32 "
        "log_softmax + gather + the loss formula in eager PyTorch; trl = TRL's selective_log_softmax path; "
        "compiled = torch.compile(plain); reference = grpo_fast.reference. Liger-Kernel's logits-level GRPO "
        "loss is a CUDA Triton kernel: it is timed by benchmarks/gpu/run_all.sh."
    )
    if not args.quick:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": dict(machine_info(), load_average_start=load_at_start, load_average=os.getloadavg()),
                    "baseline": "plain",
                    "trl": installed_version("trl"),
                    "results": results,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
