"""benchmarks/bench_attention_grids.py: one grid against grids of like length, on the same
samples of one trainer per layout, both layouts, a JSON and a table."""

import json
import os
import subprocess
import sys

from grpo_fast.packing.layout import CALL_COST

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_benchmark_times_both_call_costs_on_both_layouts(tmp_path):
    script = os.path.join(REPO, "benchmarks", "bench_attention_grids.py")
    args = [sys.executable, script, "--workload", "tiny", "--repeats", "1", "--output-dir", str(tmp_path)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "attention_grids_cpu_tiny.json").read_text())
    assert report["setup"]["call_costs"] == {"one_grid": 10**18, "grids": CALL_COST["cpu"]}
    for layout, one_grid_calls in (("shared_prefix", 2), ("whole_rows", 1)):
        result = report["results"][layout]
        assert result["one_grid"]["calls_per_layer"] == one_grid_calls  # per kind: causal, after a prompt
        assert result["grids"]["calls_per_layer"] >= one_grid_calls
        for cost in ("one_grid", "grids"):
            assert result[cost]["reference_s"] > 0 and result[cost]["training_s"] > 0
        assert result["speedup"]["reference_and_training"] > 0
    assert "| shared_prefix |" in out.stdout and "| whole_rows |" in out.stdout
