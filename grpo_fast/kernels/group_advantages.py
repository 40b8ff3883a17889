"""Triton group advantages: rewards to advantages and group statistics in one launch.

Order: the tile helper, the kernel, the launcher ``group_advantages_triton``.

A single program walks the groups in tiles of [BLOCK_GROUPS, BLOCK_G] (a few thousand
rewards: one launch costs more than the arithmetic, so one program is enough and the batch
std needs no cross-program reduction). For a group of G combined rewards c:

    c_i   = nansum_k(r_ik * w_k)
    mean  = sum_i c_i / G,   std = sqrt(sum_i (c_i - mean)^2 / (G - 1))       (Bessel)
    adv_i = (c_i - mean) / (std + eps)        "group"
            (c_i - mean) / (batch_std + eps)  "batch" (std of all N combined rewards)
            c_i - mean                        "none"
"""

import torch
import triton
import triton.language as tl

from grpo_fast.outputs import GroupAdvantages

SCALE_KINDS = {"group": 0, "batch": 1, "none": 2}
MAX_TILE = 1024  # rewards per tile


@triton.jit
def _combined_tile(rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """Returns (c [BLOCK_GROUPS, BLOCK_G] combined rewards (0 outside), sample index, valid mask)."""
    groups = g0 + tl.arange(0, BLOCK_GROUPS)[:, None]
    members = tl.arange(0, BLOCK_G)[None, :]
    valid = (groups < num_groups) & (members < G)
    sample = groups * G + members
    c = tl.zeros([BLOCK_GROUPS, BLOCK_G], tl.float32)
    for k in range(0, K):
        r = tl.load(rewards_ptr + sample * K + k, mask=valid, other=0.0) * tl.load(weights_ptr + k)
        c += tl.where(r == r, r, 0.0)  # NaN (not scored) counts as 0, as nansum
    return c, sample, valid


@triton.jit
def _group_advantages_kernel(
    rewards_ptr,  # [N, K] float32 contiguous, N = num_groups * G
    weights_ptr,  # [K] float32
    adv_ptr,  # [N] float32 out
    combined_ptr,  # [N] float32 out
    mean_ptr,  # [num_groups] float32 out
    std_ptr,  # [num_groups] float32 out
    frac_zero_std_ptr,  # [1] float32 out
    num_groups,
    G,
    K,
    eps,
    SCALE: tl.constexpr,  # 0 group, 1 batch, 2 none
    BLOCK_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    N = num_groups * G
    batch_std = 0.0
    if SCALE == 1:
        total = tl.zeros([BLOCK_GROUPS, BLOCK_G], tl.float32)
        for g0 in range(0, num_groups, BLOCK_GROUPS):
            c, sample, valid = _combined_tile(rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS, BLOCK_G)
            total += c
        batch_mean = tl.sum(tl.sum(total, 1), 0) / N
        m2 = tl.zeros([BLOCK_GROUPS, BLOCK_G], tl.float32)
        for g0 in range(0, num_groups, BLOCK_GROUPS):
            c, sample, valid = _combined_tile(rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS, BLOCK_G)
            diff = tl.where(valid, c - batch_mean, 0.0)
            m2 += diff * diff
        batch_std = tl.sqrt(tl.sum(tl.sum(m2, 1), 0) / (N - 1))
    zero_std = tl.zeros([BLOCK_GROUPS], tl.float32)
    for g0 in range(0, num_groups, BLOCK_GROUPS):
        c, sample, valid = _combined_tile(rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS, BLOCK_G)
        mean = tl.sum(c, 1) / G
        centred = tl.where(valid, c - mean[:, None], 0.0)
        std = tl.sqrt(tl.sum(centred * centred, 1) / (G - 1))
        groups = g0 + tl.arange(0, BLOCK_GROUPS)
        tl.store(mean_ptr + groups, mean, mask=groups < num_groups)
        tl.store(std_ptr + groups, std, mask=groups < num_groups)
        zero_std += tl.where((groups < num_groups) & (std <= 1e-8), 1.0, 0.0)  # torch.isclose(std, 0)
        if SCALE == 0:
            adv = centred / (std[:, None] + eps)
        elif SCALE == 1:
            adv = centred / (batch_std + eps)
        else:
            adv = centred
        tl.store(combined_ptr + sample, c, mask=valid)
        tl.store(adv_ptr + sample, adv, mask=valid)
    tl.store(frac_zero_std_ptr, tl.sum(zero_std, 0) / num_groups)


def group_advantages_triton(
    rewards: torch.Tensor,
    G: int,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    reward_weights=None,
    block_groups=None,
) -> GroupAdvantages:
    """rewards [N] or [N, K] (arguments already validated), group size G -> GroupAdvantages,
    as ``reference.group_advantages``. ``block_groups`` (a power of two) sets the tile height."""
    r = rewards.float()
    r = (r.unsqueeze(1) if r.dim() == 1 else r).contiguous()  # [N, K]
    N, K = r.shape
    num_groups = N // G
    w = torch.ones(K, device=r.device) if reward_weights is None else reward_weights.float().contiguous()
    adv = torch.empty(N, dtype=torch.float32, device=r.device)
    combined = torch.empty_like(adv)
    mean = torch.empty(num_groups, dtype=torch.float32, device=r.device)
    std = torch.empty_like(mean)
    frac_zero_std = torch.empty(1, dtype=torch.float32, device=r.device)
    block_g = triton.next_power_of_2(G)
    if block_groups is None:
        block_groups = max(1, min(triton.next_power_of_2(num_groups), MAX_TILE // block_g))
    _group_advantages_kernel[(1,)](
        r, w, adv, combined, mean, std, frac_zero_std, num_groups, G, K, float(eps),
        SCALE=SCALE_KINDS[scale], BLOCK_GROUPS=block_groups, BLOCK_G=block_g,
    )  # fmt: skip
    return GroupAdvantages(adv, combined, mean, std, frac_zero_std.reshape(()))
