"""The packed attention on one grid against grids of like length, inside the trainer.

A pack's attention is a few SDPA calls, each on sequences of like length
(``grpo_fast.packing.grids.attention_grids``), as the host's cost model predicts pays
(``grpo_fast.packing.cost``: a call's fixed cost against its grid's padding). With padding that
costs nothing, every pack attends on one grid per kind (causal rows; completions after
their prompt), as before the grids were split. This script times both on
the same step: one trainer per layout (shared prefix, whole rows), one rollout each, then the
reference pass (``prepare``) and a training pass's backward (``accumulate_gradients``),
alternating the call costs, median of the repeats after a warm-up.

    python benchmarks/bench_attention_grids.py                  # realistic: results/attention_grids_cpu.json
    python benchmarks/bench_attention_grids.py --workload tiny --repeats 1 --output-dir /tmp   # smoke test
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, print_table  # noqa: E402
from trainer_bench.workloads import WORKLOADS  # noqa: E402

from grpo_fast.packing.cost import HOST_COSTS  # noqa: E402

# Padding that costs nothing: every span of a kind then shares one call (the layout's choice of
# shared or whole rows still sees the calls' fixed cost and the dense layers')
ONE_GRID = HOST_COSTS["cpu"]._replace(row=0.0, causal=0.0, masked=0.0, gather=0.0)


def time_layout(work, shared_prefix: bool, costs: dict, repeats: int, seed: int) -> dict:
    """``{cost name: {reference_s, training_s, calls_per_layer}}`` for one trainer of ``work``,
    every cost on the same samples (the rollout after one step), alternating, medians;
    ``calls_per_layer``: the SDPA calls a layer makes in a pass, over all its micro-batches."""
    trainer = work.trainer(steps=2, loss_type="grpo", generator="sampler", seed=seed, shared_prefix=shared_prefix)
    trainer.run_step()
    samples = trainer.source.next(trainer.data_position, trainer.version)
    times = {name: [] for name in costs}
    saved = HOST_COSTS["cpu"]
    try:
        for repeat in range(repeats + 1):  # the first round warms up
            for name, cost in costs.items():
                HOST_COSTS["cpu"] = cost
                start = time.perf_counter()
                batch = trainer.prepare(samples)
                prepared = time.perf_counter()
                trainer.accumulate_gradients(batch, None)
                trainer.optimizer.zero_grad(set_to_none=True)
                if repeat:
                    calls = sum(len(packed.grids.calls) for packed in batch.micro_batches)
                    times[name].append((prepared - start, time.perf_counter() - prepared, calls))
    finally:
        HOST_COSTS["cpu"] = saved
    return {
        name: dict(
            reference_s=statistics.median(t[0] for t in rows),
            training_s=statistics.median(t[1] for t in rows),
            calls_per_layer=rows[0][2],
        )
        for name, rows in times.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="realistic")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = WORKLOADS[args.workload](args)
    costs = {"one_grid": ONE_GRID, "grids": HOST_COSTS["cpu"]}
    results, rows = {}, []
    for name, shared in (("shared_prefix", True), ("whole_rows", False)):
        results[name] = time_layout(work, shared, costs, args.repeats, args.seed)
        one, split = results[name]["one_grid"], results[name]["grids"]
        both = {key: one[key + "_s"] / split[key + "_s"] for key in ("reference", "training")}
        total = (one["reference_s"] + one["training_s"]) / (split["reference_s"] + split["training_s"])
        results[name]["speedup"] = dict(both, reference_and_training=total)
        rows.append(
            dict(
                layout=name,
                calls=f"{one['calls_per_layer']} -> {split['calls_per_layer']}",
                reference=f"{one['reference_s']:.3f} -> {split['reference_s']:.3f} s ({both['reference']:.2f}x)",
                training=f"{one['training_s']:.3f} -> {split['training_s']:.3f} s ({both['training']:.2f}x)",
                both=f"{total:.2f}x",
            )
        )
    print_table(rows, ["layout", "calls", "reference", "training", "both"])
    report = dict(
        benchmark="attention_grids",
        workload=args.workload,
        setup=dict(
            repeats=args.repeats,
            threads=args.threads,
            seed=args.seed,
            host_costs={name: cost._asdict() for name, cost in costs.items()},
        ),
        machine=machine_info(),
        results=results,
    )
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"attention_grids_cpu_{args.workload}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
