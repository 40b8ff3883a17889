"""group_advantages: per-group reward normalisation (GRPO's critic-free baseline).

The work is O(N) on a few thousand rewards, so the torch path is the reference itself;
CUDA tensors take one Triton launch (``grpo_fast/kernels/group_advantages.py``).
"""

import math
from collections.abc import Sequence

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.outputs import GroupAdvantages
from grpo_fast.spec import SCALES


def _check(rewards, group_size, scale, eps, reward_weights) -> int:
    """Validates the arguments; returns the group size."""
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dtype.is_complex or rewards.dtype == torch.bool:
        raise TypeError(f"rewards must be a real tensor, got {rewards.dtype}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if rewards.dim() == 2 and group_size is None:
        G, N = rewards.shape[1], rewards.numel()
        if reward_weights is not None:
            raise ValueError(
                "reward_weights needs rewards [N, K] with group_size; a 2-D rewards without "
                f"group_size is read as [num_groups, G], got shape {list(rewards.shape)}"
            )
    elif rewards.dim() in (1, 2):
        if group_size is None:
            raise ValueError(f"group_size is required for rewards of shape {list(rewards.shape)} ([N] or [N, K])")
        G, N = group_size, rewards.shape[0]
    else:
        raise ValueError(f"rewards must be [N], [num_groups, G] or [N, K], got shape {list(rewards.shape)}")
    if not isinstance(G, int) or G < 2:
        raise ValueError(f"group_size must be an int >= 2 (the std of one sample is undefined), got {G!r}")
    if N == 0 or N % G != 0:
        raise ValueError(f"the number of samples N={N} must be a positive multiple of group_size={G}")
    if reward_weights is not None:
        K = rewards.shape[1] if rewards.dim() == 2 else 1
        numbers = isinstance(reward_weights, Sequence) and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in reward_weights
        )
        if isinstance(reward_weights, torch.Tensor):
            shape = list(reward_weights.shape)
        elif numbers:
            shape = [len(reward_weights)]
        else:
            raise TypeError(f"reward_weights must be a tensor or a list of K = {K} numbers, got {reward_weights!r}")
        if shape != [K]:
            raise ValueError(f"reward_weights must be of shape [K] = [{K}] (one weight per reward column), got {shape}")
    return G


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    reward_weights: torch.Tensor | Sequence[float] | None = None,
) -> GroupAdvantages:
    """Advantages of G samples per prompt relative to their group.

    Args:
        rewards: [N] with ``group_size``; [num_groups, G] without it; or [N, K] with
            ``group_size``, one column per reward function. Samples of a group are adjacent.
            NaN means "not scored": it counts as 0 in the weighted sum over functions (nansum);
            a completion that no function scored (every column NaN) is left out of its group's
            mean and std and gets advantage 0, as in TRL.
        group_size: G, samples per prompt (>= 2).
        scale: "group" divides by the group's std, "batch" by the std over the whole batch,
            "none" only centres (Dr. GRPO). Stds are unbiased (Bessel), as ``torch.std``.
        eps: added to the std before dividing.
        reward_weights: [K] weights of the reward functions, a tensor or a list of floats
            (default: all 1).

    Returns:
        :class:`GroupAdvantages` ``(advantages [N], rewards [N], mean [num_groups],
        std [num_groups], frac_zero_std [])``, float32. A group whose rewards are all equal
        gets advantage exactly 0. ``rewards`` is NaN for unscored completions; a group's mean
        is NaN when none of it was scored, its std when fewer than two were. frac_zero_std is
        the fraction of groups whose scored rewards are all equal, whatever ``scale``.

    Example:
        >>> adv = group_advantages(torch.tensor([1., 0., 0., 1.]), group_size=2).advantages
    """
    G = _check(rewards, group_size, scale, eps, reward_weights)
    if rewards.dim() == 2 and group_size is None:  # [num_groups, G] is [N] with group_size G
        rewards = rewards.reshape(-1)
    if reward_weights is not None:
        reward_weights = torch.as_tensor(reward_weights, dtype=torch.float32, device=rewards.device)
    backend = select_backend(rewards)
    if backend == "triton":
        from grpo_fast.kernels.group_advantages import group_advantages_triton

        return group_advantages_triton(rewards, G, scale=scale, eps=eps, reward_weights=reward_weights)
    return reference.group_advantages(rewards, G, scale=scale, eps=eps, reward_weights=reward_weights)
