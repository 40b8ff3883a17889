"""The demo's metrics in every trainer mode, to show that a change to the trainer moves no number.

    python benchmarks/demo_metrics.py run DIR            # DIR/<mode>/metrics.jsonl for each mode
    python benchmarks/demo_metrics.py compare OLD NEW    # identical, timing keys aside?

Run it at the old commit (``PYTHONPATH=<old checkout>``) and at the new one, then compare. The
modes are the demo (seed 0) as a user runs it, synchronous, with a rollout worker
(``--max-staleness 1``), on vLLM's and on Hugging Face's ``generate``, and a run resumed from a
checkpoint; more modes go through the code paths the demo leaves out: several optimisation
passes over micro-batches with the sampling correction, dynamic sampling, the fused LM head,
the tool task's multi-turn rollouts with the calculator, and PPO's critic.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

# name -> flags of `grpo-fast train` beside --output and --seed 0
MODES = {
    "sync": [],
    "async": ["--max-staleness", "1"],
    "vllm": ["--generator", "vllm"],
    "hf": ["--generator", "hf"],
    "passes": [
        "--steps",
        "60",
        "--num-iterations",
        "2",
        "--max-tokens-per-micro-batch",
        "300",
        "--max-staleness",
        "1",
        "--sampling-correction",
        "sequence_truncate",
    ],
    "dynamic": ["--steps", "60", "--dynamic-sampling", "--max-tokens-per-micro-batch", "400"],
    "fused": ["--steps", "60", "--fused-linear", "--num-iterations", "2"],
    "tools": ["--task", "tool_arithmetic", "--tools", "calculator", "--steps", "60"],
}
RESUME_FROM = "sync"  # the resumed run repeats this mode's last 100 steps from a checkpoint
PPO = """
import sys
from grpo_fast.bench.ppo import PPO
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
trainer = GRPOTrainer(GRPOConfig(output_dir=sys.argv[1], steps=40, progress=False, seed=0), strategy=PPO())
trainer.train()
trainer.close()
"""


def _train(output: str, flags: list) -> None:
    command = [sys.executable, "-m", "grpo_fast", "train", "--output", output, "--seed", "0", "--no-progress"]
    subprocess.run(command + flags, check=True)


def run(directory: str) -> None:
    for name, flags in MODES.items():
        print(f"== {name}", flush=True)
        extra = ["--save-every", "100", "--keep-checkpoints", "5"] if name == RESUME_FROM else []
        _train(os.path.join(directory, name), flags + extra)
    print("== resumed", flush=True)
    resumed = os.path.join(directory, "resumed")
    shutil.copytree(os.path.join(directory, RESUME_FROM), resumed)
    checkpoints = os.path.join(resumed, "checkpoints")
    shutil.rmtree(os.path.join(checkpoints, sorted(os.listdir(checkpoints))[-1]))
    _train(resumed, MODES[RESUME_FROM] + ["--save-every", "100", "--keep-checkpoints", "5", "--resume"])
    print("== ppo", flush=True)
    subprocess.run([sys.executable, "-c", PPO, os.path.join(directory, "ppo")], check=True)


def _rows(path: str) -> list:
    from grpo_fast.trainer.run.run_log import TIMING_KEYS

    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in f]


def compare(old: str, new: str) -> bool:
    same = True
    for name in sorted(os.listdir(old)):
        a, b = (_rows(os.path.join(d, name, "metrics.jsonl")) for d in (old, new))
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) == len(b):
            print(f"{name}: {len(a)} rows identical")
            continue
        same = False
        if diff is None:
            print(f"{name}: {len(a)} rows against {len(b)}")
        else:
            keys = [k for k in a[diff].keys() | b[diff].keys() if a[diff].get(k) != b[diff].get(k)]
            print(f"{name}: row {diff} differs in {sorted(keys)}")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run").add_argument("directory")
    both = commands.add_parser("compare")
    both.add_argument("old")
    both.add_argument("new")
    args = parser.parse_args()
    if args.command == "run":
        run(args.directory)
    else:
        sys.exit(0 if compare(args.old, args.new) else 1)


if __name__ == "__main__":
    main()
