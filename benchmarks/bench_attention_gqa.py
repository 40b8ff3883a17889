"""Grouped-query heads in the packed attention: passed to SDPA as they are against repeated.

``packed_sdpa`` gathers the key and value heads as they are. On CPU it then passes them to
SDPA with ``enable_gqa``; on CUDA it repeats each call's grids to the query heads
(``_kernels_take_gqa``). This script times one forward and backward of ``packed_sdpa`` on the
long-prompt layout (2 groups of G = 16, prompts of 900-1100 tokens, completions of 1-128) at
Qwen2.5-0.5B's heads (14 query heads, 2 key-value heads of 64), each way in a fresh process:
the peak RSS growth of the first call, then the median of the timed repeats.

    python benchmarks/bench_attention_gqa.py        # -> results/attention_gqa_cpu.json
    python benchmarks/bench_attention_gqa.py --quick --output-dir /tmp   # smoke test
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, peak_rss_growth, print_table, run_isolated  # noqa: E402

import grpo_fast.packing.attention as packed_attention  # noqa: E402
from grpo_fast.packing import pack_micro_batches, packed_sdpa  # noqa: E402


def layout(shared: bool, quick: bool):
    """The pack: 2 groups of G rows, a prompt of 900-1100 tokens each, completions of 1-128."""
    groups, G, (low, high), C = (2, 4, (20, 30), 8) if quick else (2, 16, (900, 1100), 128)
    g = torch.Generator().manual_seed(0)
    ids = torch.full((groups * G, high + C), 5, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k in range(groups):
        length = int(torch.randint(low, high + 1, (), generator=g))
        for i in range(k * G, k * G + G):
            mask[i, high - length : high + int(torch.randint(1, C + 1, (), generator=g))] = 1
    return pack_micro_batches(ids, mask, C, None, None, G if shared else None)[0]


def worker(config: dict) -> dict:
    torch.set_num_threads(config["threads"])
    packed_attention._kernels_take_gqa = lambda query: config["kv_heads"] == "as_they_are"
    packed = layout(config["shared"], config["quick"])
    S = packed.input_ids.shape[1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 14, S, 64, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 64, generator=g, requires_grad=True) for _ in range(2))

    def step():
        packed_sdpa(None, q, k, v, None, packed_grids=packed.grids)[0].sum().backward()

    growth = peak_rss_growth(step)
    times = []
    for _ in range(config["repeats"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return dict(tokens=S, peak_rss_growth_bytes=growth, fwd_bwd_s=statistics.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny layout (smoke test)")
    parser.add_argument("--worker")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    results, rows = {}, []
    for name, shared in (("shared_prefix", True), ("whole_rows", False)):
        for kv_heads in ("repeated", "as_they_are"):
            config = dict(shared=shared, kv_heads=kv_heads, repeats=args.repeats, threads=args.threads)
            config["quick"] = args.quick
            results.setdefault(name, {})[kv_heads] = run_isolated(os.path.abspath(__file__), config)
        repeated, native = results[name]["repeated"], results[name]["as_they_are"]
        results[name]["speedup"] = repeated["fwd_bwd_s"] / native["fwd_bwd_s"]
        results[name]["peak_ratio"] = native["peak_rss_growth_bytes"] / max(repeated["peak_rss_growth_bytes"], 1)
        rows.append(
            dict(
                layout=name,
                tokens=native["tokens"],
                time=f"{repeated['fwd_bwd_s']:.3f} -> {native['fwd_bwd_s']:.3f} s ({results[name]['speedup']:.2f}x)",
                peak=f"{repeated['peak_rss_growth_bytes'] >> 20} -> {native['peak_rss_growth_bytes'] >> 20} MiB",
            )
        )
    print_table(rows, ["layout", "tokens", "time", "peak"])
    report = dict(benchmark="attention_gqa", setup=vars(args), machine=machine_info(), results=results)
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "attention_gqa_cpu.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
