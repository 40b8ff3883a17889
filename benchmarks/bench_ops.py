"""CPU benchmark of the fused ops against the eager reference: fwd+bwd time and peak memory.

Each (case, implementation) runs in a fresh subprocess, which reports the growth of its
peak RSS during one loss forward + backward, then the median (20%, 80%) of timed repeats
after a warm-up. Speed-ups and memory ratios are taken between runs of the same script.

    python benchmarks/bench_ops.py                 # full table, writes benchmarks/results/ops_cpu.json
    python benchmarks/bench_ops.py --quick         # tiny shapes (smoke test)
"""

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, peak_rss_growth, print_table, run_isolated, time_fn  # noqa: E402

# (name, B, T, V, dtype): ~4096 tokens at a Llama-2-sized vocabulary, and Qwen's vocabulary.
CASES = [
    ("loss_bf16_32k", 8, 512, 32768, "bfloat16"),
    ("loss_fp32_32k", 8, 512, 32768, "float32"),
    ("loss_bf16_152k", 4, 256, 151936, "bfloat16"),
    ("logprobs_nograd_bf16_32k", 8, 512, 32768, "bfloat16"),
]
QUICK_CASES = [(name, 2, 16, 1000, dtype) for name, _, _, _, dtype in CASES]
IMPLS = ("eager", "fused", "fused_inplace")


def worker(config: dict) -> dict:
    import torch

    import grpo_fast
    from grpo_fast import reference

    torch.manual_seed(0)
    B, T, V = config["B"], config["T"], config["V"]
    dtype = getattr(torch, config["dtype"])
    logits = torch.randn(B, T, V, dtype=dtype)
    ids = torch.randint(0, V, (B, T))
    with torch.no_grad():
        logp = grpo_fast.token_logprobs(logits, ids)
    old, ref = logp + 0.1 * torch.randn(B, T), logp + 0.3 * torch.randn(B, T)
    adv, mask = torch.randn(B), torch.ones(B, T)
    impl, nograd = config["impl"], config["name"].startswith("logprobs")
    logprobs_fn = {"eager": reference.token_logprobs}.get(impl, grpo_fast.token_logprobs)
    loss_fn = {"eager": reference.grpo_loss}.get(impl, grpo_fast.grpo_loss)
    if impl == "trl":  # TRL's own path: selective_log_softmax, then its per-token formula (= the reference's)
        from trl.trainer.utils import selective_log_softmax as logprobs_fn

        def loss_fn(logits, ids, *args, **options):
            return reference.policy_loss(logprobs_fn(logits, ids), *args, **options)

    setup = None
    if nograd:

        def step():
            with torch.no_grad():
                logprobs_fn(logits, ids)

    else:
        extra = {"inplace_backward": True} if impl == "fused_inplace" else {}
        logits.requires_grad_()
        if impl == "fused_inplace":  # the gradient overwrites the logits: restore them, untimed
            pristine = logits.detach().clone()

            def setup():
                logits.data.copy_(pristine)

        def step():
            out = loss_fn(logits, ids, adv, mask, old, ref, beta=0.04, **extra)
            torch.autograd.grad(out.loss, logits)  # as an LM head would receive it: no .grad copy

    peak = peak_rss_growth(step)
    timing = time_fn(step, warmup=1, repeats=config["repeats"], setup=setup)
    return {"peak_bytes": peak, **timing}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (smoke test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "ops_cpu.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    cases = QUICK_CASES if args.quick else CASES
    repeats = 1 if args.quick else args.repeats
    results, rows = [], []
    competitors = {mod: importlib.util.find_spec(mod) is not None for mod in ("trl", "liger_kernel")}
    for name, B, T, V, dtype in cases:
        impls = IMPLS if not name.startswith("logprobs") else ("eager", "fused")
        impls += ("trl",) if competitors["trl"] else ()
        by_impl = {}
        for impl in impls:
            config = dict(name=name, impl=impl, B=B, T=T, V=V, dtype=dtype, repeats=repeats)
            by_impl[impl] = run_isolated(__file__, config)
            results.append({**config, **by_impl[impl]})
            print(f"{name} {impl}: {by_impl[impl]}", file=sys.stderr)
        row = {"case": name, "dtype": dtype, "tokens": B * T, "V": V}
        eager = by_impl["eager"]
        for impl, res in by_impl.items():
            if "error" in res:
                row[f"{impl} s"] = "error"
                continue
            row[f"{impl} s"] = f"{res['median_s']:.3f}"
            row[f"{impl} peak MB"] = f"{res['peak_bytes'] / 2**20:.0f}"
            if impl != "eager" and "error" not in eager:
                row[f"{impl} speed-up"] = f"{eager['median_s'] / res['median_s']:.2f}x"
                row[f"{impl} mem ratio"] = f"{res['peak_bytes'] / max(eager['peak_bytes'], 1):.2f}"
        rows.append(row)

    columns = ["case", "dtype", "tokens", "V", "eager s", "fused s", "fused speed-up", "fused_inplace speed-up",
               "trl speed-up", "eager peak MB", "fused peak MB", "fused mem ratio", "fused_inplace mem ratio",
               "trl mem ratio"]  # fmt: skip
    print_table(rows, columns)
    print(f"\ninstalled competitors: {competitors}. trl = TRL's selective_log_softmax + its per-token loss "
          "(its columns, like ours, are relative to eager); Liger-Kernel's logits-level GRPO loss is a CUDA "
          "Triton kernel, so it is timed in benchmarks/gpu/run_all.sh, not here.")  # fmt: skip
    if not args.quick:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "competitors": competitors, "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
