"""benchmarks/long_context_accounting.py: the split of bytes a token into per layer and once
from two layer counts (points given here), and its ``attention`` mode at two lengths (two
fresh processes of a few seconds): a peak that grows with the mask it copies. The lengths are
long enough that SDPA's float copy of the mask (4 B an element: 2 and 21 MB) is mapped on its
own, above glibc's mmap threshold, and so shows in the peak RSS however the heap stood."""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(REPO, "benchmarks"))  # after tests/: its conftest is not ours
import long_context_accounting  # noqa: E402


def _point(trainer, layers, length, peak):
    return dict(trainer=trainer, layers=layers, length=length, peak_bytes=peak)


def test_per_layer_split_from_two_layer_counts():
    G = long_context_accounting.GROUP
    # 100 B a completion token once, 10 B a token per layer; 1,000 B of constant per layer
    points = [_point("grpo_fast", k, n, 1000 * k + G * n * (100 + 10 * k)) for k in (2, 8) for n in (16, 32)]
    points.append(_point("trl", 2, 16, 5))  # one length: no slope, no split
    ours, trl = long_context_accounting.per_layer_split(points)
    assert ours["bytes_per_token_at_layers"] == {2: pytest.approx(120), 8: pytest.approx(180)}
    assert ours["per_layer_bytes_per_token"] == pytest.approx(10)
    assert ours["once_bytes_per_token"] == pytest.approx(100)
    assert trl == dict(trainer="trl", bytes_per_token_at_layers={})


def test_attention_peak_grows_with_its_mask(tmp_path):
    path = tmp_path / "attention.json"
    assert long_context_accounting.main(["attention", "--lengths", "256", "1024", "--json", str(path)]) == 0
    short, long = json.loads(path.read_text())["points"]
    assert (short["length"], long["length"]) == (256, 1024)
    assert long["mask_elements"] == long_context_accounting.GROUP * 1024 * (long_context_accounting.PROMPT + 1024)
    growth = long["peak_bytes"] - short["peak_bytes"]
    assert growth > 4 * (long["mask_elements"] - short["mask_elements"])  # the float copy, and more
    assert long["forward_peak_bytes"] > 4 * long["mask_elements"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["layers", "--layer-counts", "0", "2"], "--layer-counts must be ints >= 1"),
        (["layers", "--trainers", "verl"], "--trainers must be of grpo_fast, trl"),
        (["layers", "--checkpointing", "maybe"], "--checkpointing must be on or off"),
        (["trl-step", "--token-chunk", "0"], "--token-chunk must be >= 1"),
    ],
    ids=["layer-count", "trainer", "checkpointing", "token-chunk"],
)
def test_bad_options_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit):
        long_context_accounting.main(argv)
    assert message in capsys.readouterr().err
