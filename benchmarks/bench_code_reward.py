"""Throughput of code_reward: completions per second for a batch of 64 simple programs.

Each completion is a fenced Python function with 3-4 assert tests (the bundled
sample_code tasks and their reference solutions, 16 copies each), so the time is the
sandbox's own cost: a bootstrap interpreter, namespaces and mounts, the program, the
tests. Configurations:

    workers=1                one sandbox at a time
    workers=cores            the default pool (one sandbox per available core)
    workers=2*cores          oversubscribed (process start-up waits on the kernel, not only the CPU)
    workers=cores, fallback  GRPO_FAST_SANDBOX_NO_NAMESPACES=1: no namespaces, to price the isolation itself

Each tree is timed in a worker process of its own that imports grpo_fast from it. With
`--baseline DIR` (a source tree of another version, e.g. `git clone --shared . /tmp/base
&& git -C /tmp/base checkout <commit>`), every configuration is timed for both,
interleaved repeat by repeat so that the machine's load falls on both alike, and the table
gains their ratio. Median (20%, 80%) of timed repeats after one warm-up batch. Every batch
must score 1.0 on every completion (checked), so a broken sandbox cannot look fast.

    python benchmarks/bench_code_reward.py --baseline /tmp/base   # writes results/code_reward.json
    python benchmarks/bench_code_reward.py --quick                # 8 completions, 2 repeats, no JSON
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, print_table, quantiles  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "is_palindrome": "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n",
    "fizzbuzz": "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)\n",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
}


def make_batch(n: int):
    """n completions and their assert tests, cycling through the sample_code tasks that use asserts."""
    with open(os.path.join(REPO, "grpo_fast", "tasks", "data", "sample_code.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    tasks = [(row, code) for row in rows for name, code in SOLUTIONS.items() if f"`{name}(" in row["prompt"]]
    picked = [tasks[i % len(tasks)] for i in range(n)]
    return (
        [row["prompt"] for row, _ in picked],
        [f"```python\n{code}```" for _, code in picked],
        [row["tests"] for row, _ in picked],
    )


def worker(n: int) -> None:
    """`--worker`: for each stdin line "WORKERS FALLBACK", times one batch; prints its seconds."""
    from grpo_fast.rewards import SandboxLimits, code_reward

    prompts, completions, tests = make_batch(n)
    limits = SandboxLimits(wall_time_s=10.0)
    for line in sys.stdin:
        workers, fallback = map(int, line.split())
        # Both names: the fallback switch of this version and of the one before it.
        for name in ("GRPO_FAST_SANDBOX_NO_NAMESPACES", "GRPO_FAST_SANDBOX_UNPRIVILEGED"):
            os.environ[name] = str(fallback)
        start = time.perf_counter()
        rewards = code_reward(prompts, completions, tests=tests, limits=limits, max_workers=workers)
        elapsed = time.perf_counter() - start
        if rewards != [1.0] * n:
            raise RuntimeError(f"the reference solutions must all score 1.0, got {rewards}")
        print(elapsed, flush=True)


class Worker:
    def __init__(self, tree: str, n: int):
        env = {**os.environ, "PYTHONPATH": tree}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def time(self, workers: int, fallback: bool) -> float:
        self.proc.stdin.write(f"{workers} {int(fallback)}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a benchmark worker failed (see its traceback above)")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _commit(tree: str | None) -> str | None:
    """The baseline's git commit (its path if it is no checkout)."""
    if tree is None:
        return None
    found = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() if found.returncode == 0 else tree


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="source tree of the version to compare with")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n, repeats = (8, 2) if args.quick else (args.batch, args.repeats)
    if args.worker:
        return worker(n)
    cores = len(os.sched_getaffinity(0))
    configs = [
        ("workers=1", 1, False),
        ("workers=cores", cores, False),
        ("workers=2*cores", 2 * cores, False),
        ("workers=cores, fallback", cores, True),
    ]
    trees = {"current": REPO, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    workers = {name: Worker(tree, n) for name, tree in trees.items()}
    rows = []
    try:
        for config, pool, fallback in configs:
            for w in workers.values():
                w.time(pool, fallback)  # warm-up
            samples = {name: [] for name in workers}
            for _ in range(repeats):
                for name, w in workers.items():
                    samples[name].append(w.time(pool, fallback))
            row = {"config": config, "workers": pool, "batch": n}
            for name, times in samples.items():
                stats = quantiles(times)
                prefix = "" if name == "current" else "baseline_"
                row.update({prefix + k: round(v, 3) if k != "repeats" else v for k, v in stats.items()})
                row[prefix + "completions_per_s"] = round(n / stats["median_s"], 1)
            if args.baseline:
                row["ratio_vs_baseline"] = round(row["completions_per_s"] / row["baseline_completions_per_s"], 3)
            rows.append(row)
    finally:
        for w in workers.values():
            w.close()
    print(f"code_reward on {n} completions ({cores} cores available; root={os.geteuid() == 0})")
    columns = ["config", "completions_per_s", "median_s", "p20_s", "p80_s"]
    if args.baseline:
        columns += ["baseline_completions_per_s", "baseline_median_s", "ratio_vs_baseline"]
    print_table(rows, columns)
    if not args.quick:
        out = os.path.join(REPO, "benchmarks", "results", "code_reward.json")
        with open(out, "w") as f:
            json.dump(
                {
                    "machine": machine_info(),
                    "root": os.geteuid() == 0,
                    "baseline": _commit(args.baseline),
                    "rows": rows,
                },
                f,
                indent=2,
            )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
