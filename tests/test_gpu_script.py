"""benchmarks/gpu/run_all.sh --dry-run passes as the GPU machine would run it: in a clean
virtual environment with that machine's Triton 3.6 and transformers 5.17 (``_device_image``),
``python3`` the only Python on PATH, the project on PYTHONPATH and not installed.

The real CUDA run gets one try in a 15-minute lease, so everything but the device is proved
here: every stage runs its code paths (checks, timings, sweep, fused LM head, trainer step and
its rows against TRL, the pytest-benchmark suite, GRPO against PPO in memory), the results fit the tool's 8 files, every
check passes.
"""

import collections
import json
import os
import shutil
import subprocess
import sys

import _device_image
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(REPO, "benchmarks"))  # after tests/: its conftest is not ours
from trainer_bench import PHASES  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_project_is_not_installed_in_the_emulating_environment(tmp_path):
    env = _device_image.shell_env(REPO)
    found = subprocess.run(
        ["python3", "-c", "import grpo_fast; print(grpo_fast.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert found.strip() == os.path.join(REPO, "grpo_fast", "__init__.py")
    env.pop("PYTHONPATH")
    assert (
        subprocess.run(["python3", "-c", "import grpo_fast"], env=env, cwd=tmp_path, capture_output=True).returncode
        != 0
    )
    python = shutil.which("python", path=env["PATH"])
    assert python is None or subprocess.run([python], capture_output=True).returncode == 127


def test_run_all_dry_run_passes_on_the_device_image(tmp_path):
    out = tmp_path / "out"
    env = _device_image.shell_env(REPO, OUT=str(out))
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/run_all.sh", "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    files = sorted(os.listdir(out))
    assert len(files) <= 8, files
    stages = json.loads((out / "stages.json").read_text())["stages"]
    assert [s["result"] for s in stages] == ["ok"] * 8, stages
    assert "memory" in [s["stage"] for s in stages], stages
    checks = json.loads((out / "kernels_check_dryrun.json").read_text())
    assert checks["all_checks_ok"] and len(checks["checks"]) > 20, checks
    assert checks["triton"].startswith("3.6"), checks["triton"]
    # The trainer step against TRL: our row trains; TRL's trains where its wheels came along
    # (benchmarks/gpu/README.md), else it says why not; the image has no vLLM
    step = json.loads((out / "trainer_step_dryrun.json").read_text())
    shared = step["shared_prefix"]  # each group's prompt once: the same log-probs, fewer tokens
    assert shared["check_passed"] and shared["timed"] == "fwd_s", shared  # CPU: FlexAttention has no backward
    rows = {(row["layout"], row["attention"]): row for row in shared["rows"]}
    kernels = ("sdpa", "sdpa_split", "flex")
    assert set(rows) == {(layout, kernel) for layout in ("whole", "shared") for kernel in kernels}, rows
    for kernel in kernels:
        whole, once = rows["whole", kernel], rows["shared", kernel]
        assert once["forward_tokens"] < whole["forward_tokens"] and once["fwd_s"] > 0, shared["rows"]
        assert max(once["max_abs_logprob_diff_fp32"], whole["max_abs_logprob_diff_fp32"]) < 1e-4, shared["rows"]
    engines = step["engines"]
    assert set(engines["results"]["sampler"]["phases_median_s"]) == set(PHASES), engines
    assert engines["skipped"]["vllm"].startswith("vllm not installed"), engines["skipped"]
    if "trl" in engines["skipped"]:
        assert engines["skipped"]["trl"].startswith("trl not installed"), engines["skipped"]
    else:
        assert engines["results"]["trl"]["median_s"] > 0, engines["results"]["trl"]
    timings = json.loads((out / "kernels_time_dryrun.json").read_text())["timings"]
    measured = {(r["op"], r["impl"]) for r in timings if "median_ms" in r}
    for impl in ("fused", "plain", "trl", "compiled", "reference"):
        assert ("loss fwd+bwd", impl) in measured and ("log-probs no-grad", impl) in measured, impl
    # The fused LM head: its checks pass, and it is timed beside every materialised-logits baseline
    fused_linear = json.loads((out / "fused_linear_dryrun.json").read_text())
    assert all(check["passed"] for check in fused_linear["checks"]), fused_linear["checks"]
    timed = {row["impl"] for row in fused_linear["timings"] if "median_ms" in row}
    assert {"fused", "fused_gspo", "plain", "eager", "compiled"} <= timed, fused_linear["timings"]
    # The pytest-benchmark suite at tiny shapes: every implementation of each op in one group
    # (torch.compile left out, as in the CUDA run; Liger-Kernel needs CUDA).
    groups = collections.defaultdict(dict)
    for bench in json.loads((out / "pytest_benchmark_dryrun.json").read_text())["benchmarks"]:
        groups[bench["group"]][bench["extra_info"]["impl"]] = bench["stats"]["median"]
    assert len(groups) >= 4, groups.keys()
    loss_groups = [g for g in groups if g.startswith("loss fwd+bwd")]
    assert len(loss_groups) == 2, groups.keys()  # bf16 and fp32
    for group in loss_groups:
        assert set(groups[group]) == {"fused", "fused_inplace", "plain", "trl", "reference"}, group
    assert set(groups["log-probs no-grad bfloat16 32x1000 cpu"]) == {"fused", "plain", "trl", "reference"}
    assert all(t > 0 for impls in groups.values() for t in impls.values())
