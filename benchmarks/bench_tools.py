"""The tool task, ToRL in miniature: held-out pass@1 with the calculator against the same run
without it, same budget, seeds 0-2.

Each run is ``grpo-fast train --task tool_arithmetic [--tools calculator] --eval-every 50 --seed S``
(its defaults: 300 steps, one torch thread as the command line sets for a built-in task), run
in-process so that the held-out pass@1 right after the warm start (step 0) is measured by the
same evaluator as the run's own evals at steps 50, 100, ..., 300. Runs go two at a time, each
on one thread of the 2 cores.

python benchmarks/bench_tools.py --seeds 0 1 2     # -> results/tools_cpu.json, tools_cpu.png
"""

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run(seed: int, tools: bool) -> dict:
    """One run; its eval curve (step -> eval/pass@1, step 0 right after the warm start), the
    last step's metrics and its wall time, warm start included."""
    import torch

    torch.set_num_threads(1)
    from grpo_fast.trainer import GRPOConfig, GRPOTrainer

    start = time.perf_counter()
    output = os.path.join(tempfile.mkdtemp(prefix="grpo_fast_tools_"), "run")
    config = GRPOConfig.from_dict(
        dict(
            task="tool_arithmetic",
            tools=["calculator"] if tools else None,
            eval_every=50,
            seed=seed,
            output_dir=output,
            progress=False,
        )
    )
    trainer = GRPOTrainer(config)
    built = time.perf_counter() - start
    curve = {0: trainer.evaluator(0)["eval/pass@1"]}
    history = trainer.train()
    curve.update({m["step"]: m["eval/pass@1"] for m in history if "eval/pass@1" in m})
    keep = ("reward_mean", "tools/call_frequency", "tools/failure_frequency", "tools/turns_mean")
    return dict(
        seed=seed,
        tools=tools,
        pass_at_1=curve,
        last={k: history[-1][k] for k in keep if k in history[-1]},
        build_and_warm_start_s=built,
        wall_s=time.perf_counter() - start,
    )


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        steps = sorted(r["pass_at_1"], key=int)
        ax.plot(
            [int(s) for s in steps],
            [r["pass_at_1"][s] for s in steps],
            color="tab:blue" if r["tools"] else "tab:gray",
            label=f"{'calculator' if r['tools'] else 'no tools'}, seed {r['seed']}",
            marker="o",
            markersize=3,
        )
    ax.set_xlabel("training step (0: after the warm start)")
    ax.set_ylabel("held-out pass@1")
    ax.set_title("tool_arithmetic: 3-digit x 2-digit products")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", default=os.path.join(RESULTS, "tools_cpu.json"))
    args = parser.parse_args(argv)
    jobs = [(seed, tools) for seed in args.seeds for tools in (True, False)]
    with ProcessPoolExecutor(2) as pool:
        results = list(pool.map(run, *zip(*jobs)))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from grpo_fast.bench.measure import machine_info

    table = []
    for seed in args.seeds:
        arms = {r["tools"]: r for r in results if r["seed"] == seed}
        final = {tools: arms[tools]["pass_at_1"][max(arms[tools]["pass_at_1"], key=int)] for tools in arms}
        table.append(dict(seed=seed, with_tools=final[True], without=final[False], gap=final[True] - final[False]))
        print(
            f"seed {seed}: pass@1 with the calculator {arms[True]['pass_at_1'][0]:.3f} -> {final[True]:.3f} "
            f"({arms[True]['wall_s']:.0f} s), without {arms[False]['pass_at_1'][0]:.3f} -> {final[False]:.3f} "
            f"({arms[False]['wall_s']:.0f} s); gap {final[True] - final[False]:+.3f}"
        )
    out = dict(
        command="python benchmarks/bench_tools.py --seeds " + " ".join(map(str, args.seeds)),
        machine=machine_info(),
        date=time.strftime("%Y-%m-%d"),
        runs=results,
        table=table,
    )
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    plot(results, os.path.splitext(args.json)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
