"""The comparison: every round of every engine in a fresh process, the rounds alternating
the engines, and the statistics of each engine's rounds.

A round is ``python benchmarks/bench_trainer.py --worker JSON`` (``ENTRY``), which runs
:func:`worker`: the workload saved by the parent, one engine's runner, the process's memory
and the versions it imported. So no engine inherits another's allocator state, threads or
process group; the rounds alternate the engines (in the given order, reversed every other
round) so that load from other processes hits all alike. A round drops its first ``warmup``
steps; the step times of all rounds are pooled: median, 20% and 80% quantiles.
"""

import functools
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import time

import torch

from grpo_fast.bench.measure import current_rss_bytes, peak_rss_bytes, quantiles, run_isolated
from trainer_bench import PHASES, REQUIRES, TRL_ENGINES
from trainer_bench.grpo_fast_runner import run_grpo_fast
from trainer_bench.trl_runner import run_trl
from trainer_bench.workloads import Workload

# the command line, whose --worker runs worker() in the fresh process
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_trainer.py")


RUNNERS = {
    **{engine: functools.partial(run_grpo_fast, generator=engine) for engine in ("sampler", "hf", "vllm")},
    # every row whole in the training, reference and old-log-prob passes (--no-shared-prefix)
    **{
        f"{engine}_whole": functools.partial(run_grpo_fast, generator=engine, shared_prefix=False)
        for engine in ("sampler", "hf", "vllm")
    },
    "trl": functools.partial(run_trl, use_vllm=False),
    "trl_vllm": functools.partial(run_trl, use_vllm=True),
}


def worker(options: dict) -> dict:
    """One round of one engine in this (fresh) process: its per-step record, the process's
    resident set before the trainer is built and its peak, and the versions it imported."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # patch 1: the engine in this process
    torch.set_num_threads(options["threads"])
    work = Workload.load(options["workload_dir"])
    rss_start = current_rss_bytes()
    out = RUNNERS[options["engine"]](work, options)
    out.update(rss_start_bytes=rss_start, peak_rss_bytes=peak_rss_bytes(), torch_threads=torch.get_num_threads())
    out["pid"] = os.getpid()  # the round's own process (not in the report)
    if options["device"] == "cuda":
        out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    out["versions"] = {
        name: sys.modules[name].__version__ for name in ("torch", "transformers", "trl", "vllm") if name in sys.modules
    }
    return out


def runnable(engines) -> tuple:
    """``(engines whose packages are installed here, {engine: why not} for the others)``."""
    missing = {module for engine in engines for module in REQUIRES[engine] if importlib.util.find_spec(module) is None}
    skipped = {
        engine: f"{', '.join(sorted(set(REQUIRES[engine]) & missing))} not installed"
        for engine in engines
        if set(REQUIRES[engine]) & missing
    }
    return [engine for engine in engines if engine not in skipped], skipped


def summarize(runs: list, warmup: int) -> dict:
    """Pooled step statistics of an engine's rounds (those without an error), its phases'
    medians, peak RSS and the rounds' own records."""
    errors = [run["error"] for run in runs if "error" in run]
    runs = [run for run in runs if "error" not in run]
    rounds = [
        dict(
            round=run["round"],
            median_s=statistics.median(run["times"][warmup:]),
            median_cpu_s=statistics.median(run["cpu_times"][warmup:]),
            peak_rss_bytes=run["peak_rss_bytes"],
            rss_start_bytes=run["rss_start_bytes"],
            torch_threads=run["torch_threads"],
            loadavg_start=run["loadavg_start"],
            loadavg_end=run["loadavg_end"],
            **{key: run[key] for key in ("vllm", "peak_cuda_bytes", "sampling_logp_difference_mean") if key in run},
        )
        for run in runs
        if len(run["times"]) > warmup
    ]
    if not rounds:
        return dict(errors=errors or ["no round ran more than --warmup steps"])
    times = [t for run in runs for t in run["times"][warmup:]]
    stats = quantiles(times)
    stats["steps_per_s"] = 1.0 / stats["median_s"]
    # CPU seconds of the process per step: with one thread, what the step costs whatever the load
    stats["median_cpu_s"] = statistics.median(t for run in runs for t in run["cpu_times"][warmup:])
    stats["tokens_per_s"] = statistics.median(t for run in runs for t in run["tokens"][warmup:]) / stats["median_s"]
    lengths = [n for run in runs for n in run["lengths"][warmup:] if n is not None]
    stats["completion_len_mean"] = statistics.mean(lengths) if lengths else None
    steps = [phase for run in runs for phase in run["phases"][warmup:]]
    stats["phases_median_s"] = {name: statistics.median(step[name] for step in steps) for name in PHASES}
    stats["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    forward = [n for run in runs for n in run.get("forward_tokens", [])[warmup:]]
    if forward:  # grpo_fast's: what the model's body ran per step in its training pass
        stats["forward_tokens_per_step"] = statistics.median(forward)
        stats["prefix_saved"] = statistics.median(x for run in runs for x in run["prefix_saved"][warmup:])
    layouts = [layout for run in runs for layout in run.get("layouts", [])[warmup:]]
    if layouts:
        total = {key: sum(layout[key] for layout in layouts) for key in layouts[0]}
        stats["padding_fraction_of_padded_batch"] = 1 - total["real"] / total["padded"]
        if "prefill_ours" in total:
            stats["prefill_tokens_saved"] = 1 - total["prefill_ours"] / total["prefill_per_sample"]
    stats["rounds"] = rounds
    if errors:
        stats["errors"] = errors
    return stats


def run_round(work_dir: str, engine: str, options: dict, deadline: float | None) -> dict:
    """One round of ``engine`` in a fresh process (``worker``), with the machine's load average
    before and after; ``{"error": ...}`` when it fails, or when it would start or run past
    ``deadline`` (a ``time.monotonic()`` value; None: no limit)."""
    timeout = 1800.0 if deadline is None else deadline - time.monotonic()
    if timeout < 1:
        return {"error": "not run: the time budget was spent"}
    start_load = os.getloadavg()[0]
    env = dict(os.environ, OMP_NUM_THREADS=str(options["threads"]))
    command = [sys.executable, ENTRY]
    try:
        run = run_isolated(command, dict(options, engine=engine, workload_dir=work_dir), timeout, env)
    except subprocess.TimeoutExpired:
        run = {"error": f"cut after {timeout:.0f} s: the time budget was spent"}
    return dict(run, loadavg_start=start_load, loadavg_end=os.getloadavg()[0])


def compare(work: Workload, engines: list, options: dict, rounds: int, warmup: int, deadline=None) -> tuple:
    """Runs ``rounds`` rounds of each engine, a fresh process each (``run_round``, before
    ``deadline``), alternating the engines: in ``engines``' order, reversed every other
    round. Returns ``({engine: summarize(...)}, {package: version} of the workers)``; per TRL
    engine measured, every other engine's result gains its steps/s against it (pooled, and
    round by round)."""
    folder = work.save()
    runs = {engine: [] for engine in engines}
    for r in range(rounds):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            run = dict(run_round(folder, engine, options, deadline), round=r)
            runs[engine].append(run)
            if "error" in run:
                print(f"  {work.name} {engine} round {r}: error: {run['error']}", flush=True)
            else:
                median = statistics.median(run["times"][warmup:] or [0.0])
                load = f"{run['loadavg_start']:.1f} -> {run['loadavg_end']:.1f}"
                print(
                    f"  {work.name} {engine} round {r}: median step {median:.3f} s, peak RSS "
                    f"{run['peak_rss_bytes'] / 2**20:.0f} MiB, load {load}",
                    flush=True,
                )
    results = {engine: summarize(runs[engine], warmup) for engine in engines}
    measured = [engine for engine in engines if "median_s" in results[engine]]
    for base in [engine for engine in TRL_ENGINES if engine in measured]:
        base_rounds = {r["round"]: r["median_s"] for r in results[base]["rounds"]}
        for engine in measured:
            if engine == base:
                continue
            r = results[engine]
            r[f"steps_per_s_vs_{base}"] = r["steps_per_s"] / results[base]["steps_per_s"]
            r[f"steps_per_s_vs_{base}_per_round"] = [
                base_rounds[x["round"]] / x["median_s"] for x in r["rounds"] if x["round"] in base_rounds
            ]
    versions = {}
    for run in itertools.chain(*runs.values()):
        versions.update(run.get("versions", {}))
    return results, versions
