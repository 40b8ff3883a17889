"""Return types shared by the reference and every backend."""

from typing import NamedTuple

import torch


class GroupAdvantages(NamedTuple):
    """Output of :func:`grpo_fast.group_advantages`.

    advantages:     [N] float32, the per-sample advantage (first field: unpack it alone).
    rewards:        [N] float32, the combined reward (weighted nansum over reward functions).
    mean:           [num_groups] float32, group means of ``rewards``.
    std:            [num_groups] float32, unbiased group standard deviations.
    frac_zero_std:  [] float32, fraction of groups whose rewards are all equal.
    """

    advantages: torch.Tensor
    rewards: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    frac_zero_std: torch.Tensor


class LossOutput(NamedTuple):
    """Output of :func:`grpo_fast.grpo_loss`: ``loss`` to backpropagate, the rest detached.

    Every metric is a 0-dim float32 tensor on the loss's device (no host sync); metrics are
    averaged over active (mask = 1) tokens, or over sequences for sequence-level ratios.
    ``kl`` is None when no ``ref_logprobs`` were given; ``entropy`` is None unless asked for.
    """

    loss: torch.Tensor
    kl: torch.Tensor | None
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio_region: torch.Tensor
    ratio_mean: torch.Tensor
    entropy: torch.Tensor | None
