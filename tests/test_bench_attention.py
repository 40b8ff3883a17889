"""The packed attention's benchmarks: bench_attention_grids.py (one grid against grids of like
length, on the same samples of one trainer per layout) and bench_attention_gqa.py (grouped-query
heads passed to SDPA as they are against repeated, a fresh process each); both layouts, a JSON
and a table each."""

import json
import os
import subprocess
import sys

import pytest

from grpo_fast.packing.cost import HOST_COSTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *options, tmp_path):
    args = [sys.executable, os.path.join(REPO, "benchmarks", script), *options, "--output-dir", str(tmp_path)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| shared_prefix |" in out.stdout and "| whole_rows |" in out.stdout


def test_the_grids_benchmark_times_both_call_costs_on_both_layouts(tmp_path):
    run("bench_attention_grids.py", "--workload", "tiny", "--repeats", "1", tmp_path=tmp_path)
    report = json.loads((tmp_path / "attention_grids_cpu_tiny.json").read_text())
    costs = report["setup"]["host_costs"]
    assert costs["grids"] == HOST_COSTS["cpu"]._asdict() and costs["one_grid"]["causal"] == 0
    for layout, one_grid_calls in (("shared_prefix", 2), ("whole_rows", 1)):
        result = report["results"][layout]
        assert result["one_grid"]["calls_per_layer"] == one_grid_calls  # per kind: causal, after a prompt
        assert result["grids"]["calls_per_layer"] >= one_grid_calls
        one, grids, speedup = result["one_grid"], result["grids"], result["speedup"]
        # each speedup is one grid's time over the grids', per pass and for both passes
        for key in ("reference", "training"):
            assert speedup[key] == pytest.approx(one[key + "_s"] / grids[key + "_s"]) and grids[key + "_s"] > 0
        both = (one["reference_s"] + one["training_s"]) / (grids["reference_s"] + grids["training_s"])
        assert speedup["reference_and_training"] == pytest.approx(both)
        # a ratio of sums lies between the ratios of its parts
        low, high = sorted((speedup["reference"], speedup["training"]))
        assert low * (1 - 1e-12) <= speedup["reference_and_training"] <= high * (1 + 1e-12)


def test_the_gqa_benchmark_times_both_ways_in_fresh_processes(tmp_path):
    run("bench_attention_gqa.py", "--quick", "--repeats", "1", tmp_path=tmp_path)
    report = json.loads((tmp_path / "attention_gqa_cpu.json").read_text())
    for layout in ("shared_prefix", "whole_rows"):
        result = report["results"][layout]
        assert result["repeated"]["tokens"] == result["as_they_are"]["tokens"] > 0
        repeated, native = result["repeated"], result["as_they_are"]
        assert result["speedup"] == pytest.approx(repeated["fwd_bwd_s"] / native["fwd_bwd_s"])
        assert result["peak_ratio"] == pytest.approx(
            native["peak_rss_growth_bytes"] / max(repeated["peak_rss_growth_bytes"], 1)
        )
    shared, whole = (report["results"][layout]["as_they_are"]["tokens"] for layout in ("shared_prefix", "whole_rows"))
    assert shared < whole  # each group's prompt once
