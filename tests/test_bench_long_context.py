"""benchmarks/bench_long_context.py: ``--quick`` on the tiny preset writes a curve whose peak
and time grow with the completion length (two fresh processes of our trainer's step; TRL's
side, 12 s of import a process, is left to the benchmark's own runs), the curves' summaries
and the side-by-side ratios from points given here, and clear errors for bad options."""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(REPO, "benchmarks"))  # after tests/: its conftest is not ours
import bench_long_context  # noqa: E402


def test_quick_curve_grows_with_length(tmp_path, capsys):
    path = tmp_path / "long.json"
    # with grpo_fast's own options: the MLPs in tiles of 256 positions, the layer inputs offloaded
    argv = ["--quick", "--trainers", "grpo_fast", "--mlp-tile-tokens", "256", "--offload", "on", "--json", str(path)]
    assert bench_long_context.main(argv) == 0
    results = json.loads(path.read_text())
    (curve,) = results["curves"]
    assert (curve["trainer"], curve["model"], curve["checkpointing"]) == ("grpo_fast", "tiny", True)
    assert (curve["mlp_tile_tokens"], curve["activation_offloading"]) == (256, True)
    short, long = curve["points"]
    assert (short["length"], long["length"]) == (64, 1024)
    assert long["completion_tokens"] == 16 * short["completion_tokens"] == 4 * 1024
    assert long["forwarded_tokens"] == 8 + 4 * 1024  # the prompt once
    assert long["peak_bytes"] > short["peak_bytes"] > 0  # the step's activations grow with L
    assert long["step_s"] > 0 and set(long["phases"]) == {"prepare_s", "forward_backward_s", "optimizer_s"}
    assert curve["bytes_per_completion_token"] > 0 and len(curve["time_exponents"]) == 1
    assert curve["longest_fitting_length"] == 1024
    assert results["meta"]["kv_cache_bytes_per_token"]["tiny"] == 2 * 2 * 4 * 16 * 4  # 2 layers, 4 heads of 16
    assert (tmp_path / "long.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _point(length, peak, seconds, G=4):
    return dict(length=length, completion_tokens=G * length, peak_bytes=peak, step_s=seconds)


def test_summaries_and_side_by_side_ratios():
    cap = 100.0
    # ours: 10 B a completion token over 20 of constant; TRL 40 B a token over 40
    ours = [_point(n, 20 + 10 * 4 * n, 1.0 * n) for n in (1, 2)]
    theirs = [_point(n, 40 + 40 * 4 * n, 3.0 * n * n) for n in (1, 2)] + [dict(length=4, skipped="over a cap")]
    summary = bench_long_context.summarize(ours, cap, 4)
    assert summary["bytes_per_completion_token"] == pytest.approx(10)
    assert summary["time_exponents"] == [pytest.approx(1.0)]
    assert summary["longest_fitting_length"] == 2 and summary["extrapolated_longest_length"] == pytest.approx(2.0)
    curves = [  # ours with one layer input in three: checkpointing on, against TRL's
        dict(trainer="grpo_fast", model="m", checkpointing=3, points=ours, **summary),
        dict(
            trainer="trl", model="m", checkpointing=True, points=theirs, **bench_long_context.summarize(theirs, cap, 4)
        ),
    ]
    (row,) = bench_long_context.compare(curves, cap, 4)
    assert row["lengths"] == [1, 2] and row["peak_ratios"] == [pytest.approx(60 / 200), pytest.approx(100 / 360)]
    assert row["slope_ratio"] == pytest.approx(0.25) and row["time_ratios"][1] == pytest.approx(2 / 12)
    assert "longest_fitting_ratio" not in row  # TRL fitted none under the cap


def test_trl_runs_its_own_checkpointing_only_and_each_curve_once():
    args = bench_long_context.argparse.Namespace(
        checkpointing=["on", "every3"],
        mlp_tile_tokens=[0, 64],
        offload=["off", "on"],
        models=["m"],
        trainers=["grpo_fast", "trl"],
    )
    ran = {("grpo_fast", "m", True, 0, False)}  # in an included JSON
    curves = bench_long_context.curves_to_run(args, ran)
    keys = [bench_long_context.curve_key(c) for c in curves]
    assert len(keys) == len(set(keys)) == 8 and ran.isdisjoint(keys)
    assert [k for k in keys if k[0] == "trl"] == [("trl", "m", True, 0, False)]


def test_extrapolation_stops_a_curve_before_a_point_over_a_cap():
    peak, seconds = bench_long_context._extrapolated([_point(1, 20, 1.0), _point(2, 30, 4.0)], 4)
    assert peak == pytest.approx(50) and seconds == pytest.approx(16.0)  # along the line; exponent 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "huge"], "--models: unknown"),
        (["--trainers", "verl"], "--trainers must be of"),
        (["--checkpointing", "maybe"], "--checkpointing must be of"),
        (["--lengths", "64", "32"], "--lengths must be ascending"),
        (["--mlp-tile-tokens", "-1"], "--mlp-tile-tokens must be ints >= 0"),
        (["--offload", "maybe"], "--offload must be of"),
        (["--trainers", "grpo_fast", "--offload", "on", "--checkpointing", "off"], "--offload on needs checkpointing"),
        (["--device", "cuda"], "--device must be cpu, or cuda with --trainers grpo_fast"),
        (["--group-size", "1"], "--group-size must be >= 2"),
        (["--time-cap-s", "0"], "--time-cap-s must be > 0"),
    ],
)
def test_bad_options_name_the_argument(argv, message, capsys):
    assert bench_long_context.main(argv) == 2
    assert message in capsys.readouterr().err
