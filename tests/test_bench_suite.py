"""The pytest-benchmark suite (benchmarks/test_bench_ops.py) runs at tiny shapes and saves
JSON with every implementation of each op in one group.

torch.compile is left out here: inductor's C++ build takes tens of seconds on 2 cores; it
runs in the full suite and in benchmarks/bench_ops.py.
"""

import collections
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_suite_runs_at_tiny_shapes_and_groups_every_implementation(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "benchmarks/",
        "--benchmark-only",
        "--bench-shape",
        "tiny",
        "--bench-device",
        "cpu",
        "--benchmark-min-rounds",
        "1",
        "--benchmark-max-time",
        "0.001",
        "--benchmark-warmup",
        "off",
        "-k",
        "not compiled",
        "-p",
        "no:cacheprovider",
        "-q",
        "--benchmark-json",
        str(out),
    ]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    groups = collections.defaultdict(dict)
    for bench in json.loads(out.read_text())["benchmarks"]:
        groups[bench["group"]][bench["extra_info"]["impl"]] = bench["stats"]["median"]
    loss_groups = [g for g in groups if g.startswith("loss fwd+bwd")]
    assert len(loss_groups) == 2, groups.keys()  # bf16 and fp32
    for group in loss_groups:
        assert set(groups[group]) == {"fused", "fused_inplace", "plain", "trl", "reference"}, group
    assert set(groups["log-probs no-grad bfloat16 32x1000 cpu"]) == {"fused", "plain", "trl", "reference"}
    assert all(t > 0 for impls in groups.values() for t in impls.values())
