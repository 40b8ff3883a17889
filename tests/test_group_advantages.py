"""group_advantages against hand-computed values, on every backend."""

import math
import statistics

import pytest
import torch
from conftest import rel_err

import grpo_fast
from grpo_fast import reference


def by_hand(rewards, G, scale, eps=1e-4):
    """Plain-Python advantages of a flat list of rewards (the DeepSeekMath recipe)."""
    out = []
    everyone = statistics.stdev(rewards)
    for i in range(0, len(rewards), G):
        group = rewards[i : i + G]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        div = {"group": std + eps, "batch": everyone + eps, "none": 1.0}[scale]
        out += [(r - mean) / div for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_hand_computation(backend, scale):
    rewards = [1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0]
    out = grpo_fast.group_advantages(torch.tensor(rewards), 4, scale=scale)
    assert rel_err(out.advantages, torch.tensor(by_hand(rewards, 4, scale), dtype=torch.float64)) < 1e-6
    assert out.advantages[4:8].abs().max() == 0  # an all-equal group: exactly 0, never NaN
    assert out.frac_zero_std.item() == pytest.approx(1 / 3)
    assert out.mean.shape == (3,) and out.std.shape == (3,)
    assert out.std[0].item() == pytest.approx(statistics.stdev(rewards[:4]), rel=1e-6)


def test_grouped_2d_input_equals_flat(backend):
    rewards = torch.rand(5, 6)
    flat = grpo_fast.group_advantages(rewards.flatten(), 6)
    grouped = grpo_fast.group_advantages(rewards)
    assert torch.equal(flat.advantages, grouped.advantages)


def test_reward_columns_weights_and_nan(backend):
    """[N, K] columns: weighted nansum, NaN = that function did not score the sample."""
    columns = torch.tensor([[1.0, float("nan")], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    weights = torch.tensor([2.0, 0.5])
    out = grpo_fast.group_advantages(columns, 2, reward_weights=weights)
    combined = [2.0, 0.5, 2.5, 0.0]
    assert out.rewards.tolist() == combined
    assert rel_err(out.advantages, torch.tensor(by_hand(combined, 2, "group"), dtype=torch.float64)) < 1e-6
    assert torch.isfinite(out.advantages).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_are_left_out(backend, scale):
    """A completion no reward function scored (every column NaN) is left out of its group's
    mean and std and of the batch std, and gets advantage 0 (TRL); a group with one scored
    completion has no std, and its one advantage is 0."""
    nan = float("nan")
    columns = torch.tensor(
        [[1.0, nan], [0.0, 1.0], [nan, nan], [1.0, 1.0], [nan, 0.0], [0.0, 0.0], [nan, nan], [3.0, nan], [nan, nan]]
    )
    weights = [2.0, 0.5]  # a list, as TRL's config holds it
    out = grpo_fast.group_advantages(columns, 3, scale=scale, reward_weights=weights)
    scored = [2.0, 0.5, 2.5, 0.0, 0.0]
    assert torch.isnan(out.rewards[[2, 6, 8]]).all()
    assert out.rewards[[0, 1, 3, 4, 5, 7]].tolist() == scored + [6.0]
    everyone = statistics.stdev(scored + [6.0])
    div = {"group": None, "batch": everyone + 1e-4, "none": 1.0}[scale]
    first = by_hand([2.0, 0.5], 2, "group" if div is None else "none")
    second = by_hand([2.5, 0.0, 0.0], 3, "group" if div is None else "none")
    if div is not None:
        first, second = [a / div for a in first], [a / div for a in second]
    want = first[:2] + [0.0] + second + [0.0, 0.0, 0.0]
    assert rel_err(out.advantages, torch.tensor(want, dtype=torch.float64)) < 1e-6
    assert out.mean[2].item() == 6.0 and math.isnan(out.std[2].item())
    assert out.frac_zero_std.item() == 0.0


def test_eps_and_dtype(backend):
    out = grpo_fast.group_advantages(torch.tensor([0, 1, 1, 1], dtype=torch.int64), 2, eps=0.5)
    assert out.advantages.dtype == torch.float32
    assert out.advantages[0].item() == pytest.approx(-0.5 / (math.sqrt(0.5) + 0.5), rel=1e-6)


def test_matches_reference_at_random(backend):
    rewards = torch.randn(64, 3)
    weights = torch.tensor([1.0, 0.2, -0.3])
    out = grpo_fast.group_advantages(rewards, 8, scale="batch", reward_weights=weights)
    expected = reference.group_advantages(rewards.double(), 8, scale="batch", reward_weights=weights.double())
    for got, want in zip(out, expected):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((torch.rand(6),), {}, ValueError, "group_size is required"),
        ((torch.rand(6), 4), {}, ValueError, "multiple of group_size=4"),
        ((torch.rand(6), 1), {}, ValueError, "group_size must be an int >= 2"),
        ((torch.rand(3, 1),), {}, ValueError, "group_size must be an int >= 2"),
        ((torch.rand(2, 2, 2),), {}, ValueError, "rewards must be"),
        (([1.0, 0.0], 2), {}, TypeError, "rewards must be a torch.Tensor"),
        ((torch.rand(4), 2), {"scale": "std"}, ValueError, "scale must be one of"),
        ((torch.rand(4), 2), {"eps": -1.0}, ValueError, "eps must be"),
        ((torch.rand(4, 3), 2), {"reward_weights": torch.ones(2)}, ValueError, r"reward_weights must be .*\[3\]"),
        ((torch.rand(4, 3),), {"reward_weights": torch.ones(3)}, ValueError, "reward_weights needs rewards"),
    ],
)
def test_bad_input(backend, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        grpo_fast.group_advantages(*args, **kwargs)
