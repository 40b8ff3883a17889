"""The built-in environment task: held-out success at guessing a number from 1 to 8 when the
environment's higher/lower answers can be read, against the same run with one guess
(``max_turns 1``) and against the blind control (three guesses, every wrong one answered
"wrong"), seeds 0-2.

Each arm is ``grpo-fast train --task guess_number --seed S`` with the task's own settings
(TASK_SETTINGS: 300 steps of 64 episodes, 8 per target, eval every 50 steps), run in a fresh
process that evaluates right after the warm start too (step 0), with the same evaluator as the
run's own evals (the 32 balanced held-out games, 8 samples each, temperature 1):

    feedback   the task as it ships (max_turns 3, higher/lower)
    one_guess  --max-turns 1: no answer is ever read (pass@1 is 1/8 for any policy)
    blind      --environment grpo_fast.environments.guess_number:GuessNumberBlind (3 guesses,
               "wrong"; no policy beats 3/8)

Runs go two at a time, each on one thread of the 2 cores.

python benchmarks/bench_guess_number.py --seeds 0 1 2     # -> results/guess_number_cpu.json
"""

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARMS = {
    "feedback": {},
    "one_guess": {"max_turns": 1},
    "blind": {"environment": "grpo_fast.environments.guess_number:GuessNumberBlind"},
}


def run(seed: int, arm: str, steps: int | None) -> dict:
    """One run; its eval curve (step -> eval/pass@1, step 0 right after the warm start), the
    last step's environment metrics and its wall time, warm start included."""
    import torch

    torch.set_num_threads(1)
    from grpo_fast.trainer import GRPOConfig, GRPOTrainer

    start = time.perf_counter()
    output = os.path.join(tempfile.mkdtemp(prefix="grpo_fast_guess_number_"), "run")
    overrides = {"steps": steps} if steps else {}
    config = GRPOConfig.from_dict(
        dict(task="guess_number", seed=seed, output_dir=output, progress=False, **ARMS[arm], **overrides)
    )
    trainer = GRPOTrainer(config)
    built = time.perf_counter() - start
    curve = {0: trainer.evaluator(0)["eval/pass@1"]}
    history = trainer.train()
    curve.update({m["step"]: m["eval/pass@1"] for m in history if "eval/pass@1" in m})
    keep = ("reward_mean", "env/success", "env/turns_mean", "env/errors", "entropy", "kl")
    return dict(
        seed=seed,
        arm=arm,
        pass_at_1=curve,
        last={k: history[-1][k] for k in keep if k in history[-1]},
        build_and_warm_start_s=built,
        wall_s=time.perf_counter() - start,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="override the task's 300 steps")
    parser.add_argument("--json", default=os.path.join(RESULTS, "guess_number_cpu.json"))
    args = parser.parse_args(argv)
    jobs = [(seed, arm, args.steps) for seed in args.seeds for arm in ARMS]
    with ProcessPoolExecutor(2, max_tasks_per_child=1) as pool:  # a fresh process per run
        results = list(pool.map(run, *zip(*jobs)))
    from grpo_fast.bench.measure import machine_info

    table = []
    for seed in args.seeds:
        arms = {r["arm"]: r for r in results if r["seed"] == seed}
        final = {arm: r["pass_at_1"][max(r["pass_at_1"])] for arm, r in arms.items()}
        row = dict(seed=seed, **final, gap_one_guess=final["feedback"] - final["one_guess"])
        row["gap_blind"] = final["feedback"] - final["blind"]
        table.append(row)
        print(
            f"seed {seed}: pass@1 with feedback {arms['feedback']['pass_at_1'][0]:.3f} -> {final['feedback']:.3f} "
            f"({arms['feedback']['wall_s']:.0f} s); one guess {final['one_guess']:.3f}; blind {final['blind']:.3f}; "
            f"gap {row['gap_one_guess']:+.3f} over one guess, {row['gap_blind']:+.3f} over blind"
        )
    out = dict(
        command="python benchmarks/bench_guess_number.py --seeds "
        + " ".join(map(str, args.seeds))
        + (f" --steps {args.steps}" if args.steps else ""),
        machine=machine_info(),
        date=time.strftime("%Y-%m-%d"),
        runs=results,
        table=table,
    )
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
