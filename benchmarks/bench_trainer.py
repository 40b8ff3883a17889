"""Trainer throughput on CPU: grpo_fast's GRPOTrainer against TRL's GRPOTrainer, side by side.

Both train the demo's tiny Llama (fresh from the same seed) with the same tokenizer, reward
(``arithmetic_reward``), G, batch, completion length, loss type, beta and learning rate, and
the same thread count. A step's time is the interval between the ends of consecutive
steps: data, sampling, rewards, reference log-probs, the update and the per-step logging. Rounds alternate (ours, TRL, ours, TRL, ...) so that load from other
processes hits both alike; each round builds a fresh trainer, drops its first ``--warmup``
steps, and the per-step times of all rounds are pooled: median, 20% and 80% quantiles.

    python benchmarks/bench_trainer.py                 # writes benchmarks/results/trainer_cpu.json
    python benchmarks/bench_trainer.py --steps 10 --rounds 1 --no-trl   # quick look

tokens/s counts prompt + completion tokens of the batch (completion tokens up to EOS).
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from grpo_fast.bench.measure import machine_info, quantiles
from grpo_fast.tasks.arithmetic import arithmetic_reward, build_dataset, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer, run_log

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "trainer_cpu.json")


def run_ours(args, steps: int) -> tuple:
    """Per-step seconds and tokens of one fresh grpo_fast run."""
    config = GRPOConfig(
        steps=steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        beta=args.beta,
        learning_rate=args.learning_rate,
        warmup_steps=0,
        loss_type="grpo",
        output_dir=tempfile.mkdtemp(prefix="bench-grpo-fast-"),
        progress=False,
        seed=args.seed,
    )
    trainer = GRPOTrainer(config)
    os.makedirs(trainer.output_dir, exist_ok=True)
    times, tokens = [], []
    last = time.perf_counter()
    for _ in range(steps):  # the body of GRPOTrainer.train, less its progress bar
        metrics = trainer.train_step()
        trainer.history.append(metrics)
        run_log.append_metrics(trainer.output_dir, metrics)
        now = time.perf_counter()
        times.append(now - last)
        last = now
        tokens.append(metrics["tokens_per_s"] * metrics["step_time_s"])
    return times, tokens


def run_trl(args, steps: int) -> tuple:
    """Per-step seconds and tokens of one fresh TRL run (timed by a callback around each step)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    tokenizer = build_tokenizer()
    # TRL builds its reference model from the policy's path, so the policy goes through a folder.
    model_dir = tempfile.mkdtemp(prefix="bench-model-")
    build_model(tokenizer, seed=args.seed).save_pretrained(model_dir)
    dataset = Dataset.from_list(build_dataset(seed=args.seed))

    class StepTimer(TrainerCallback):
        """Time between the ends of consecutive steps: the data loader, the step and the logging."""

        def __init__(self):
            self.times, self.last = [], None

        def on_train_begin(self, *unused, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, *unused, **kwargs):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    timer = StepTimer()
    config = TRLConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        beta=args.beta,
        learning_rate=args.learning_rate,
        warmup_steps=0,
        lr_scheduler_type="constant",
        loss_type="grpo",
        temperature=1.0,
        top_p=1.0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = TRLTrainer(
        model=model_dir,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    cumulative = [log["num_tokens"] for log in trainer.state.log_history if "num_tokens" in log]
    tokens = [b - a for a, b in zip([0.0] + cumulative[:-1], cumulative)]
    return timer.times, tokens


def summarize(times: list, tokens: list) -> dict:
    stats = quantiles(times)
    stats["steps_per_s"] = 1.0 / stats["median_s"]
    stats["tokens_per_s"] = statistics.median(tokens) / stats["median_s"]
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25, help="steps per round, warm-up included")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.005)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both (the demo uses 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trl", action="store_true", help="only time grpo_fast")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    try:
        import trl

        trl_version = None if args.no_trl else trl.__version__
    except ImportError:
        trl_version = None
        print("TRL is not installed (pip install trl): timing grpo_fast only")

    runners = {"grpo_fast": run_ours}
    if trl_version is not None:
        runners["trl"] = run_trl
    samples = {name: ([], []) for name in runners}
    round_medians = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            times, tokens = run(args, args.steps)
            samples[name][0].extend(times[args.warmup :])
            samples[name][1].extend(tokens[args.warmup :])
            round_medians[name].append(statistics.median(times[args.warmup :]))

    results = {name: summarize(*samples[name]) for name in runners}
    if "trl" in results:
        results["speedup_steps_per_s"] = results["grpo_fast"]["steps_per_s"] / results["trl"]["steps_per_s"]
        # Round by round, so the spread that load from other processes causes is visible.
        results["speedup_per_round"] = [t / o for o, t in zip(round_medians["grpo_fast"], round_medians["trl"])]
    import transformers

    report = {
        "benchmark": "trainer step on CPU (rollout + rewards + advantages + ref log-probs + update)",
        "setup": {k: v for k, v in vars(args).items() if k not in ("output", "no_trl")},
        "model": "demo Llama, hidden 64, 2 layers, vocab 15 (grpo_fast.tasks.arithmetic)",
        "versions": {"transformers": transformers.__version__, "trl": trl_version},
        "machine": machine_info(),
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)

    print(f"{'trainer':<10} {'steps/s':>8} {'tokens/s':>9} {'median ms':>10} {'p20-p80 ms':>14}")
    for name in runners:
        r = results[name]
        spread = f"{r['p20_s'] * 1e3:.0f}-{r['p80_s'] * 1e3:.0f}"
        print(f"{name:<10} {r['steps_per_s']:8.2f} {r['tokens_per_s']:9.0f} {r['median_s'] * 1e3:10.1f} {spread:>14}")
    if "speedup_steps_per_s" in results:
        rounds = ", ".join(f"{r:.2f}x" for r in results["speedup_per_round"])
        print(f"grpo_fast / TRL steps/s: {results['speedup_steps_per_s']:.2f}x (rounds: {rounds})")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
