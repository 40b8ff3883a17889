"""The trainer benchmark's report: the JSON of a comparison (its setup, versions, machine and
each engine's statistics) and its tables.
"""

from grpo_fast.bench.measure import machine_info
from trainer_bench import PHASES, TRL_ENGINES
from trainer_bench.compare import compare, runnable
from trainer_bench.workloads import Workload


def print_results(results: dict) -> None:
    """The steps/s table (against each TRL engine measured) and the phase table."""
    measured = [engine for engine, r in results.items() if "median_s" in r]
    bases = [engine for engine in TRL_ENGINES if engine in measured]
    columns = [("steps/s", 8), ("tokens/s", 9), ("median s", 9), ("p20-p80 s", 13), ("cpu s", 7), ("len", 6)]
    columns += [("peak MiB", 9), ("body tok", 9)] + [(f"vs {base}", 12) for base in bases]
    print(f"{'engine':<14} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for engine in measured:
        r = results[engine]
        length = "-" if r["completion_len_mean"] is None else f"{r['completion_len_mean']:.1f}"
        body = f"{r['forward_tokens_per_step']:.0f}" if "forward_tokens_per_step" in r else "-"
        ratios = [r.get(f"steps_per_s_vs_{base}") for base in bases]
        spread = f"{r['p20_s']:.3g}-{r['p80_s']:.3g}"
        print(
            f"{engine:<14} {r['steps_per_s']:8.3f} {r['tokens_per_s']:9.0f} {r['median_s']:9.3g} "
            f"{spread:>13} {r['median_cpu_s']:7.3g} {length:>6} "
            f"{r['peak_rss_bytes'] / 2**20:9.0f} {body:>9} "
            + " ".join("-".rjust(12) if x is None else f"{x:11.2f}x" for x in ratios)
        )
    print(f"\nmedian seconds per step by phase\n{'engine':<14} " + " ".join(f"{p:>12}" for p in PHASES))
    for engine in measured:
        print(f"{engine:<14} " + " ".join(f"{results[engine]['phases_median_s'][p]:12.3f}" for p in PHASES))
    for engine, r in results.items():
        for error in r.get("errors", []):
            print(f"{engine}: error: {error}")


def make_report(work: Workload, args) -> dict:
    """The comparison of ``args.engines`` (default: the workload's) on ``work`` as a JSON report."""
    engines = list(args.engines or work.engines)
    if args.no_trl:
        engines = [engine for engine in engines if engine not in TRL_ENGINES]
    engines, skipped = runnable(engines)
    for engine, why in skipped.items():
        print(f"{work.name}: skipping {engine}: {why}")
    steps = args.steps or work.steps
    warmup = work.warmup if args.warmup is None else args.warmup
    if steps <= warmup:
        raise ValueError(f"--steps ({steps}) must exceed --warmup ({warmup}): no step would be timed")
    options = dict(
        steps=steps, threads=args.threads, seed=args.seed, device=args.device, trl_as_shipped=args.trl_as_shipped
    )
    results, versions = compare(work, engines, options, args.rounds, warmup)
    return {
        "benchmark": "trainer step (rollout, rewards, advantages, ref log-probs, update), a fresh process per round",
        "workload": work.name,
        "model": work.description,
        "setup": dict(
            batch_size=work.batch_size,
            group_size=work.group_size,
            max_new_tokens=work.max_new_tokens,
            beta=work.beta,
            learning_rate=work.learning_rate,
            engines=engines,
            skipped=skipped,
            rounds=args.rounds,
            steps=steps,
            warmup=warmup,
            threads=args.threads,
            seed=args.seed,
            device=args.device,
            trl_scoring="every position (as shipped on CPU)"
            if args.trl_as_shipped
            else "completion positions only (as on a GPU)",
        ),
        "versions": versions,
        "machine": machine_info(),
        "results": results,
    }
