"""The sandbox soak (benchmarks/soak_sandbox.py) at N = 300, as root and as an ordinary account.

Three blocks of 100 programs (honest, wrong and hostile, through code_reward and the python
tool) in one worker process; every guarantee of the soak must hold: no forged pass, no honest
failure, nothing reaching the host, steady throughput, no growth of fds, threads, children,
mounts, temp entries or cgroups, RSS growth under 50 MB. The full run (5,000 programs) is the
benchmark's; its JSON is in benchmarks/results/.
"""

import json
import os
import subprocess
import sys

import pytest
from _sandboxed import REPO, ROOT

SCRIPT = os.path.join(REPO, "benchmarks", "soak_sandbox.py")
PROGRAMS = 300
# At N = 300 the throughput windows are one block each (the first and the last 100 programs).
# Only a slower end fails (a faster one is the first block's cold caches, or the other xdist
# worker going quiet: CI measured 1.38x once). A block of 100 takes ~10 s on 2 cores, where one
# timeout more or less in a window's slot order or the other worker's load moves it by ~10%:
# 30% keeps the check able to catch a leak that slows the sandbox down (the full run holds 20%
# over windows of 1,000).
TOLERANCE = 0.3


@pytest.mark.slow
@pytest.mark.parametrize("caller", ["root", "user"])
def test_soak_keeps_every_guarantee(caller, tmp_path):
    if caller == "root" and not ROOT:
        pytest.skip("the root caller needs the tests to run as root")
    out = tmp_path / f"soak_{caller}.json"
    done = subprocess.run(
        [sys.executable, SCRIPT, "-n", str(PROGRAMS), "--as", caller, "--out", str(out)]
        + ["--throughput-tolerance", str(TOLERANCE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.exists(), done.stderr
    result = json.loads(out.read_text())
    assert result["isolation"] == ("root" if caller == "root" else "user"), result["isolation"]
    failed = {name: g for name, g in result["guarantees"].items() if not g["pass"]}
    assert not failed and done.returncode == 0, (failed, done.stdout[-3000:], done.stderr[-3000:])
    # Every program got a verdict, and each family ran on both routes.
    counts = result["verdicts"]
    total = sum(
        n for families in counts.values() for kinds in families.values() for v in kinds.values() for n in v.values()
    )
    assert total == PROGRAMS and all(set(families) == {"honest", "wrong", "hostile"} for families in counts.values())
    assert len(result["samples"]) == PROGRAMS // result["block"] + 1
