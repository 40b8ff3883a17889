"""Asynchronous rollouts (max_staleness K = 1) against the synchronous loop, side by side.

throughput  the realistic workload of bench_trainer.py (tiny Llama, vocabulary 32000, 4
            prompts x G = 8, up to 128 new tokens, beta 0.04): steps/s of the synchronous
            loop at 1 and at 2 torch threads and of K = 1 with the worker and the trainer
            one thread each. Rounds alternate the three so that other processes' load hits
            all alike; the first --warmup steps of each run are dropped (the worker's
            start). Per-phase times feed the cost model (benchmarks/NOTES.md):
                synchronous step  = sampling and scoring S + reference pass F + training T
                asynchronous step = max(S, T, (S + F + T) / 2) on two free cores (the
                                    reference pass goes to whichever side has the time)
demo        the built-in demo (grpo-fast train, its default 300 steps) synchronous and
            K = 1 for a few seeds: reward rise (last tenth's mean reward minus the first
            tenth's) and the reward curves by step and by wall-clock second (PNG).

python benchmarks/bench_async.py throughput --rounds 2    # -> results/async_cpu_realistic.json
python benchmarks/bench_async.py demo --seeds 0 1 2       # -> results/async_demo.json, async_demo.png
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_bench.workloads import realistic_workload  # noqa: E402

from grpo_fast.bench.measure import machine_info, quantiles  # noqa: E402
from grpo_fast.trainer import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_fast.trainer.run import run_log  # noqa: E402
from grpo_fast.trainer.update import batch as step  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

SETUPS = {  # name -> (torch threads of the process, max_staleness)
    "sync_1thread": (1, 0),
    "sync_2threads": (2, 0),
    "async_k1": (2, 1),  # the worker takes half of the threads: one each
}


def run_throughput(work, name: str, steps: int, seed: int) -> dict:
    """One fresh run of ``steps`` steps: the interval between consecutive steps' ends, and
    the phases: the rollout (make_rollout: in the synchronous loop sampling, rewards and
    reference log-probs; asynchronously the wait for the worker and the reference log-probs of
    the rows the worker left), the trainer's reference pass alone, and the step's metrics."""
    threads, staleness = SETUPS[name]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    trainer = work.trainer(steps=steps, seed=seed, max_staleness=staleness)
    phases = {"rollout_s": [], "reference_s": []}

    def timed(method, key):
        def run(*args):
            start = time.perf_counter()
            out = method(*args)
            phases[key][-1] += time.perf_counter() - start
            return out

        return run

    # the rollout: the source's samples (a wait for the worker's), then the step's batch, which
    # holds the reference pass (the rows the worker did not do)
    trainer.source.next = timed(trainer.source.next, "rollout_s")
    trainer.prepare = timed(trainer.prepare, "rollout_s")
    reference_logprobs = step.reference_logprobs
    step.reference_logprobs = timed(reference_logprobs, "reference_s")
    times, history = [], []
    try:
        last = time.perf_counter()
        for _ in range(steps):
            for values in phases.values():
                values.append(0.0)
            history.append(trainer.train_step())
            now = time.perf_counter()
            times.append(now - last)
            last = now
    finally:
        trainer.close()
        step.reference_logprobs = reference_logprobs
        torch.set_num_threads(saved)
    keys = (
        "rollout_wait_s",
        "worker_rollout_s",
        "worker_weight_wait_s",
        "worker_reference_share",
        "weight_copy_s",
        "staleness",
    )
    phases.update({key: [m[key] for m in history] for key in keys if key in history[0]})
    return dict(times=times, **phases)


def throughput(args) -> dict:
    work = realistic_workload(args)
    runs = {name: [] for name in SETUPS}
    for _ in range(args.rounds):
        for name in SETUPS:
            runs[name].append(run_throughput(work, name, args.steps, args.seed))
            print(
                f"  {name}: median step {statistics.median(runs[name][-1]['times'][args.warmup :]):.2f} s", flush=True
            )
    results = {}
    for name, rs in runs.items():
        pooled = {key: [v for r in rs for v in r[key][args.warmup :]] for key in rs[0]}
        stats = quantiles(pooled["times"])
        stats["steps_per_s"] = 1 / stats["median_s"]
        stats["phases_median_s"] = {key: statistics.median(v) for key, v in pooled.items() if key != "times"}
        results[name] = stats
    a, s1, s2 = (results[n]["steps_per_s"] for n in ("async_k1", "sync_1thread", "sync_2threads"))
    results["async_over_sync_1thread"], results["async_over_sync_2threads"] = a / s1, a / s2
    # The cost model on these two cores, from the one-thread synchronous phases: sampling and
    # scoring S, the reference pass F, training T. K = 1 on two free cores: max(S, T, (S + F + T) / 2).
    p1, pa = results["sync_1thread"]["phases_median_s"], results["async_k1"]["phases_median_s"]
    F = p1["reference_s"]
    S = p1["rollout_s"] - F
    T = results["sync_1thread"]["median_s"] - p1["rollout_s"]
    ideal = max(S, T, (S + F + T) / 2)
    measured = results["async_k1"]["median_s"]
    results["model"] = dict(
        sync_1thread_sampling_s=S,
        sync_1thread_reference_s=F,
        sync_1thread_training_s=T,
        predicted_async_step_s=ideal,
        predicted_over_sync_1thread=(S + F + T) / ideal,
        measured_async_step_s=measured,
        # > 1: what the two processes lose to each other (shared caches, memory bandwidth)
        contention=measured / ideal,
        async_worker_rollout_s=pa["worker_rollout_s"],
        async_worker_reference_share=pa["worker_reference_share"],
        async_trainer_reference_s=pa["reference_s"],
        async_trainer_busy_s=measured - pa["rollout_wait_s"],
    )
    return dict(
        setup=dict(steps=args.steps, warmup=args.warmup, rounds=args.rounds, model=work.description), results=results
    )


def demo(args) -> dict:
    """The demo (its default config, one torch thread as the CLI sets) synchronous and K = 1."""
    torch.set_num_threads(1)
    curves = {}
    for seed in args.seeds:
        for staleness in (0, 1):
            config = GRPOConfig(
                seed=seed,
                max_staleness=staleness,
                progress=False,
                output_dir=tempfile.mkdtemp(prefix="demo-"),
            )
            start = time.perf_counter()
            trainer = GRPOTrainer(config)
            stamps = []
            run_step = trainer.run_step

            def stamped(run_step=run_step, stamps=stamps):
                result = run_step()
                stamps.append(time.perf_counter() - start)
                return result

            trainer.run_step = stamped
            history = trainer.train()
            first, last = run_log.tenth_means(history)
            curves[f"seed{seed}_k{staleness}"] = dict(
                seed=seed,
                max_staleness=staleness,
                reward=[m["reward_mean"] for m in history],
                wall_s=stamps,
                rise=last - first,
            )
            print(f"  seed {seed} K={staleness}: rise {last - first:.3f} in {stamps[-1]:.1f} s", flush=True)
    rises = {k: [c["rise"] for c in curves.values() if c["max_staleness"] == k] for k in (0, 1)}
    gaps = [a - s for s, a in zip(rises[0], rises[1])]
    return dict(curves=curves, rise_sync=rises[0], rise_async=rises[1], rise_gap_per_seed=gaps)


def plot_demo(report: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.5))
    by_step, by_time = fig.subplots(1, 2)
    for curve in report["curves"].values():
        color = "tab:blue" if curve["max_staleness"] == 0 else "tab:orange"
        label = f"{'synchronous' if curve['max_staleness'] == 0 else 'K = 1'}, seed {curve['seed']}"
        smooth = [statistics.mean(curve["reward"][max(0, i - 9) : i + 1]) for i in range(len(curve["reward"]))]
        by_step.plot(range(1, len(smooth) + 1), smooth, color=color, alpha=0.8, label=label)
        by_time.plot(curve["wall_s"], smooth, color=color, alpha=0.8)
    by_step.set_xlabel("step")
    by_time.set_xlabel("wall-clock s (from the trainer's construction)")
    for ax in (by_step, by_time):
        ax.set_ylabel("reward (10-step mean)")
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def straggler_factor(sigma: float, cap: float, rows: int, trials: int = 2000, seed: int = 0) -> float:
    """kappa = E[longest of ``rows`` completions] / E[completion length] for log-normal lengths
    (median 1, log-std ``sigma``) cut at ``cap`` x the median: how much longer a synchronous,
    memory-bound decode (every step costs about the same, however few rows are still live)
    takes than generation that keeps its batch full (continuous batching)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(trials, rows, generator=g, dtype=torch.float64) * sigma).clamp(max=cap)
    return (lengths.max(1).values.mean() / lengths.mean()).item()


def predicted_gain(a: float, kappa: float) -> tuple:
    """The GPU node's model, in units of the training time T of a step on all n GPUs:

        colocated synchronous:  kappa * a + 1      (generation waits on its slowest sample)
        two pools, K >= 1:      generation a / x on a share x of the GPUs (kept full),
                                training 1 / (1 - x) on the rest
        best split x = a / (a + 1)  ->  step = a + 1

    ``a``: generation at full occupancy over training, on the same GPUs. The trainer runs no
    extra pass for the stale batches (the first training pass is the proximal one). Returns
    (gain, x)."""
    return (kappa * a + 1) / (a + 1), a / (a + 1)


def model(args) -> dict:
    """The GPU prediction for log-normal lengths and a few generation/training ratios a."""
    rows = []
    for sigma in (0.6, 1.0):
        kappa = straggler_factor(sigma, cap=8.0, rows=64)
        for a in (0.5, 1.0, 2.0):
            gain, x = predicted_gain(a, kappa)
            rows.append(dict(sigma=sigma, kappa=kappa, a=a, generation_share=x, predicted_gain=gain))
            print(f"sigma {sigma} kappa {kappa:.2f} a {a}: gain {gain:.2f}x, generation GPUs {x:.0%}")
    return dict(predictions=rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("throughput", "demo", "model"))
    parser.add_argument("--steps", type=int, default=6, help="throughput: steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="throughput: steps dropped per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="demo: seeds")
    parser.add_argument("--output-dir", default=RESULTS)
    args = parser.parse_args()
    report = dict(throughput=throughput, demo=demo, model=model)[args.what](args)
    report["machine"] = machine_info()
    os.makedirs(args.output_dir, exist_ok=True)
    name = dict(throughput="async_cpu_realistic", demo="async_demo", model="async_gpu_model")[args.what]
    path = os.path.join(args.output_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    if args.what == "demo":
        plot_demo(report, os.path.join(args.output_dir, "async_demo.png"))
        print(f"rise sync {report['rise_sync']}, K=1 {report['rise_async']}, gap {report['rise_gap_per_seed']}")
    elif args.what == "throughput":
        r = report["results"]
        print(json.dumps({k: v for k, v in r.items() if not isinstance(v, dict)}, indent=1))
        print(json.dumps(r["model"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
