"""The trainer's update, before and after a change, side by side: step time and peak memory.

The realistic workload of ``bench_trainer.py`` (Llama hidden 256, 4 layers, vocabulary
32000, 32 completions of up to 128 tokens, beta 0.04), one rollout held fixed: each timed
``train_step`` is the update alone (advantages, the packed forward and backward of every
micro-batch, the optimizer step, the log line), with the logits path and with
``fused_linear``. Each configuration runs in a fresh process (one torch thread) that builds
the trainer, samples once, warms up one step, then times ``--steps`` steps and measures its
peak RSS over them (and the peak's growth over the RSS before them). Processes alternate
between the checkouts and the two paths, round after round, so that load from other work
hits all alike.

    python benchmarks/bench_update.py --before <older checkout>   # -> results/update_cpu.json
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def worker(fused_linear: bool, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    from trainer_bench.workloads import realistic_workload

    path = os.path.join(REPO, "grpo_fast", "bench", "measure.py")
    spec = importlib.util.spec_from_file_location("measure_here", path)
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    work = realistic_workload(argparse.Namespace(seed=0))
    trainer = work.trainer(fused_linear=fused_linear)
    samples = trainer.source.next(trainer.data_position, trainer.version)
    batch = trainer.prepare(samples)  # one batch, its reference log-probs and packing included, every step
    trainer.source.next, trainer.prepare = (lambda position, version: samples), (lambda samples: batch)
    trainer.train_step()
    times = []

    def timed_steps():
        for _ in range(steps):
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)

    start_rss = measure.current_rss_bytes()
    peak = measure.peak_rss_growth(timed_steps, reset=True)
    tokens = int(batch.completion_mask.sum())
    return dict(times=times, peak_rss_growth=peak, peak_rss=start_rss + peak, completion_tokens=tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=False, help="the older checkout to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "update_cpu.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return
    trees = {"before": os.path.abspath(args.before), "after": REPO}
    runs = {(tree, fused): [] for tree in trees for fused in (False, True)}
    for _ in range(args.rounds):
        for (tree, fused), results in runs.items():
            env = dict(os.environ, PYTHONPATH=trees[tree])
            command = [sys.executable, __file__, "--worker", json.dumps(dict(fused_linear=fused, steps=args.steps))]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=trees[tree])
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(tree, "fused_linear" if fused else "logits", results[-1], flush=True)
    table = {}
    for (tree, fused), results in runs.items():
        times = [t for r in results for t in r["times"]]
        table[f"{tree} {'fused_linear' if fused else 'logits'}"] = dict(
            median_step_s=statistics.median(times),
            steps=len(times),
            peak_rss_growth_mb=statistics.median(r["peak_rss_growth"] for r in results) / 2**20,
            peak_rss_mb=statistics.median(r["peak_rss"] for r in results) / 2**20,
            completion_tokens=results[0]["completion_tokens"],
        )
    for path in ("logits", "fused_linear"):
        before, after = table[f"before {path}"], table[f"after {path}"]
        table[f"after / before, {path}"] = dict(
            step_time=after["median_step_s"] / before["median_step_s"],
            peak_rss_growth=after["peak_rss_growth_mb"] / max(before["peak_rss_growth_mb"], 1e-9),
            peak_rss=after["peak_rss_mb"] / before["peak_rss_mb"],
        )
    for key, row in table.items():
        print(f"{key:32s} {row}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        commits = {
            tree: subprocess.run(
                ["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            for tree, path in trees.items()
        }
        json.dump(dict(commits=commits, rounds=args.rounds, steps=args.steps, results=table), f, indent=1)


if __name__ == "__main__":
    main()
