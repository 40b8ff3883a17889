"""Measurement helpers shared by the benchmark scripts; they live in ``grpo_fast.bench.measure``
so that the ``grpo-fast bench`` commands of an installed package use the same code.

Peak memory on CPU is the growth of the peak resident set of a fresh process that runs
one configuration (docs/design.md, "How we measure"): ``run_isolated`` starts
``python SCRIPT --worker JSON``, and the worker reports ``peak_rss_growth`` around its first call.
"""

import sys

from grpo_fast.bench import measure
from grpo_fast.bench.measure import current_rss_bytes, machine_info, peak_rss_growth, print_table, quantiles, time_fn

__all__ = [
    "current_rss_bytes",
    "machine_info",
    "peak_rss_growth",
    "print_table",
    "quantiles",
    "run_isolated",
    "time_fn",
]


def run_isolated(script: str, config: dict, timeout: float = 1800) -> dict:
    """Runs one configuration of ``script`` in a fresh interpreter and returns the JSON it prints last."""
    return measure.run_isolated([sys.executable, script], config, timeout)
