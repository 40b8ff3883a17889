"""Throughput of code_reward: completions per second for a batch of 64 simple programs.

Each completion is a fenced Python function with 3-4 assert tests (the bundled
sample_code tasks and their reference solutions, 16 copies each), so the time is the
sandbox's own cost: a bootstrap interpreter, namespaces and mounts, the harness
interpreter, the tests. Configurations, side by side in one run:

    workers=1                one sandbox at a time
    workers=cores            the default pool (one sandbox per available core)
    workers=2*cores          oversubscribed (process start-up waits on the kernel, not only the CPU)
    workers=cores, fallback  GRPO_FAST_SANDBOX_UNPRIVILEGED=1: no namespaces, no uid change,
                             to price the isolation itself

Median (20%, 80%) of timed repeats after one warm-up batch. Every batch must score 1.0
on every completion (checked), so a broken sandbox cannot look fast.

    python benchmarks/bench_code_reward.py              # 64 completions, 5 repeats: writes results/code_reward.json
    python benchmarks/bench_code_reward.py --quick      # 8 completions, 2 repeats (smoke test, no JSON)
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, print_table, time_fn  # noqa: E402

from grpo_fast.rewards import SandboxLimits, code_reward  # noqa: E402

SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "is_palindrome": "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n",
    "fizzbuzz": "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)\n",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
}


def make_batch(n: int):
    """n completions and their assert tests, cycling through the sample_code tasks that use asserts."""
    sample = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "grpo_fast", "tasks", "data",
                          "sample_code.jsonl")
    with open(sample) as f:
        rows = [json.loads(line) for line in f]
    tasks = [(row, code) for row in rows for name, code in SOLUTIONS.items() if f"`{name}(" in row["prompt"]]
    picked = [tasks[i % len(tasks)] for i in range(n)]
    return ([row["prompt"] for row, _ in picked], [f"```python\n{code}```" for _, code in picked],
            [row["tests"] for row, _ in picked])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n, repeats = (8, 2) if args.quick else (args.batch, args.repeats)
    prompts, completions, tests = make_batch(n)
    cores = len(os.sched_getaffinity(0))
    limits = SandboxLimits(wall_time_s=10.0)
    configs = [("workers=1", 1, False), ("workers=cores", cores, False), ("workers=2*cores", 2 * cores, False),
               ("workers=cores, fallback", cores, True)]
    rows = []
    for name, workers, fallback in configs:
        if fallback:
            os.environ["GRPO_FAST_SANDBOX_UNPRIVILEGED"] = "1"

        def batch():
            rewards = code_reward(prompts, completions, tests=tests, limits=limits, max_workers=workers)
            if rewards != [1.0] * n:
                raise RuntimeError(f"{name}: the reference solutions must all score 1.0, got {rewards}")

        stats = time_fn(batch, warmup=1, repeats=repeats)
        os.environ.pop("GRPO_FAST_SANDBOX_UNPRIVILEGED", None)
        rows.append({"config": name, "workers": workers, "batch": n, **stats,
                     "completions_per_s": round(n / stats["median_s"], 1),
                     "ms_per_completion": round(1000 * stats["median_s"] / n, 1)})
    base = rows[0]["median_s"]
    for row in rows:
        row["speedup_vs_1_worker"] = round(base / row["median_s"], 2)
        for key in ("median_s", "p20_s", "p80_s"):
            row[key] = round(row[key], 3)
    print(f"code_reward on {n} completions ({cores} cores available; root={os.geteuid() == 0})")
    print_table(rows, ["config", "completions_per_s", "ms_per_completion", "median_s", "p20_s", "p80_s",
                       "speedup_vs_1_worker"])
    if not args.quick:
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "code_reward.json")
        with open(out, "w") as f:
            json.dump({"machine": machine_info(), "root": os.geteuid() == 0, "rows": rows}, f, indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
