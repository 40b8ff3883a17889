"""Every Triton kernel configuration the launchers pick compiles for sm_80 and sm_90 without
spills, and every streaming kernel keeps at least 16 warps resident per SM.

``benchmarks/gpu/occupancy.py`` captures the launches from real calls of the public ops
(under the interpreter, so the specialisations are those of production), compiles each
through ptxas for both targets without a GPU, and applies these rules. Checked with the
installed Triton (CI's) and with the GPU machine's Triton 3.6 (``_device_image``): the
code that runs there is compiled by that version. The launches are captured once and shared:
the launchers are grpo_fast's Python and pick the same launches whatever the Triton (3.6
and 3.9 record identical captures); the interpreter of 3.6 runs in test_gpu_script's dry run.
"""

import importlib.util
import json
import os
import subprocess
import sys

import _device_image
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu", "occupancy.py")
spec = importlib.util.spec_from_file_location("occupancy", SCRIPT)
occupancy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(occupancy)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Where the first report's capture is written for the other to read."""
    return tmp_path_factory.mktemp("capture") / "launches.json"


@pytest.fixture(scope="module", params=["installed triton", "device image triton 3.6"])
def report(request, launches, tmp_path_factory):
    python = sys.executable if request.param == "installed triton" else _device_image.python3()
    out = tmp_path_factory.mktemp("occupancy") / "occupancy.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    command = [python, SCRIPT, "--json", str(out), "--launches", str(launches)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert out.exists(), f"occupancy.py crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return dict(json.loads(out.read_text()), stdout=proc.stdout, returncode=proc.returncode)


@pytest.mark.slow
def test_every_kernel_is_captured_and_compiled_for_both_targets(report):
    """Every ``*_kernel`` in grpo_fast/kernels was launched by some scenario: a new kernel
    without a scenario would escape the other test."""
    import grpo_fast.kernels.group_advantages
    import grpo_fast.kernels.grpo_loss
    import grpo_fast.kernels.token_logprobs

    modules = (grpo_fast.kernels.grpo_loss, grpo_fast.kernels.token_logprobs, grpo_fast.kernels.group_advantages)
    kernels = {name for m in modules for name in vars(m) if name.endswith("_kernel")}
    for cc in occupancy.TARGETS:
        compiled = {r["kernel"] for r in report["rows"] if r["cc"] == cc}
        assert kernels <= compiled, f"sm_{cc}: never launched by a scenario: {sorted(kernels - compiled)}"


@pytest.mark.slow
def test_no_compile_error_no_spill_and_enough_resident_warps(report):
    failing = [r for r in report["rows"] if r["problems"]]
    lines = [
        f"{r['kernel']} sm_{r['cc']} {r['constexprs']} warps={r['num_warps']} "
        f"[{r.get('specialisation', '')}] in {r['scenarios'][:3]}: {'; '.join(r['problems'])}"
        for r in failing
    ]
    assert not failing, f"triton {report['triton']}:\n" + "\n".join(lines)
    assert report["returncode"] == 0


def test_occupancy_model_matches_cudas_rules():
    """The register rule the issue quotes: 128 registers at 8 warps fit 2 CTAs (16 warps)
    per SM, 129 only 1; shared memory and the 64-warp cap bind where registers do not."""
    row = dict(num_warps=8, reg=128, dynamic_shared=32, shared=0, constexprs=dict(BLOCK_V=4096), bytes_per_element=2)
    assert occupancy.occupancy(row, 90) == dict(
        ctas_per_sm=2, warps_per_sm=16, streaming=True, bytes_in_flight_per_sm=16384, rows_in_flight=264
    )
    assert occupancy.occupancy(dict(row, reg=129), 90)["warps_per_sm"] == 8
    assert occupancy.occupancy(dict(row, reg=32), 90)["warps_per_sm"] == 64  # the 64-warp cap
    assert occupancy.occupancy(dict(row, reg=32, dynamic_shared=80_000), 80)["ctas_per_sm"] == 2  # 164 KB
    assert occupancy.problems(
        dict(row, reg=129, spill_stores=0, spill_loads=0, **occupancy.occupancy(dict(row, reg=129), 90))
    )
