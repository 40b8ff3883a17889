"""Ulysses sequence parallelism: each rank's activation peak for one long sequence, against one rank's.

One packed row (a prompt of a quarter of the tokens, then its completion) through a small
float32 Llama (4 layers, hidden 256, 8 query heads, 4 key/value heads), forward and backward
of a loss on the completion tokens' log-probs, as the trainer's packed pass computes them. Each
degree runs in fresh processes (one thread each; degree 2 under torchrun on gloo): a warm-up
on a short row allocates the gradients and the process group's buffers, then the peak RSS
growth of the long row's forward and backward is the activation peak (the kernel's high-water
mark reset before it).

    python benchmarks/bench_sequence_parallel.py                  # -> results/sequence_parallel_cpu.json
    python benchmarks/bench_sequence_parallel.py --tokens 512 --output-dir /tmp   # smoke test
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, peak_rss_growth, print_table  # noqa: E402

from grpo_fast import token_logprobs  # noqa: E402
from grpo_fast.bench.measure import run_isolated  # noqa: E402
from grpo_fast.packing import (  # noqa: E402
    gather_tokens,
    pack_micro_batches,
    packed_logits,
    sequence_shard,
    use_packed_attention,
)

MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
)


def one_row(tokens: int):
    """The pack of one row of ``tokens`` tokens: a prompt of a quarter, its completion the rest."""
    completion = tokens - tokens // 4
    ids = torch.randint(3, MODEL["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    return pack_micro_batches(ids, torch.ones_like(ids), completion, None, None)[0]


def forward_backward(model, packed, group) -> None:
    """The trainer's packed pass: completion log-probs (gathered over ``group``, if any), a loss
    on them, its backward."""
    shard = sequence_shard(packed, group) if group is not None else None
    logits = packed_logits(model, packed, shard)
    targets = packed.targets if shard is None else packed.targets[:, shard.tokens]
    logp = token_logprobs(logits, targets)[0]
    if shard is not None:
        logp = gather_tokens(logp, shard)
    logp.mean().backward()


def worker(config: dict) -> None:
    """One degree's measurement; under torchrun rank 0 prints every rank's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    group = None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    torch.manual_seed(0)
    model = use_packed_attention(LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa")))
    forward_backward(model, one_row(64), group)  # gradients and the group's buffers exist from here on
    packed = one_row(config["tokens"])
    start = time.perf_counter()
    peak = peak_rss_growth(lambda: forward_backward(model, packed, group), reset=True)
    result = {"peak_rss_growth_bytes": peak, "seconds": time.perf_counter() - start}
    results = [result]
    if group is not None:
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return
    print(json.dumps({"ranks": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="the long row's tokens")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script, config = os.path.abspath(__file__), {"tokens": args.tokens}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script]
    results = {
        1: run_isolated([sys.executable, script], config, env=env),
        2: run_isolated(torchrun, config, env=env),
    }
    for degree, result in results.items():
        if "error" in result:
            raise SystemExit(f"sequence_parallel={degree}: {result['error']}")
    one = results[1]["ranks"][0]["peak_rss_growth_bytes"]
    rows = [
        {
            "sequence_parallel": degree,
            "rank": rank,
            "peak_rss_growth_MiB": round(r["peak_rss_growth_bytes"] / 2**20, 1),
            "vs_one_rank": round(r["peak_rss_growth_bytes"] / one, 3),
            "seconds": round(r["seconds"], 2),
        }
        for degree, result in results.items()
        for rank, r in enumerate(result["ranks"])
    ]
    print_table(rows, list(rows[0]))
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "sequence_parallel_cpu.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), "model": MODEL, "tokens": args.tokens, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
