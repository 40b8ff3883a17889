"""Triton group advantages: rewards to advantages and group statistics in one launch.

Order: the tile helper, the kernel, the launcher ``group_advantages_triton``.

A single program walks the groups in tiles of [BLOCK_GROUPS, BLOCK_G] (a few thousand
rewards: one launch costs more than the arithmetic, so one program is enough and the batch
std needs no cross-program reduction). For a group of G combined rewards c, of which the
n scored ones (some reward function returned a number, s_i = 1) count:

    c_i   = nansum_k(r_ik * w_k)
    mean  = sum_i s_i c_i / n,   std = sqrt(sum_i s_i (c_i - mean)^2 / (n - 1))   (Bessel; NaN if n < 2)
    adv_i = (c_i - mean) / (std + eps)        "group"
            (c_i - mean) / (batch_std + eps)  "batch" (std of every scored combined reward)
            c_i - mean                        "none"
    adv_i = 0 where s_i = 0 or the division is NaN, and c_i = NaN where s_i = 0 (as TRL)
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.token_logprobs import device_guard
from grpo_fast.outputs import GroupAdvantages

SCALE_KINDS = {"group": 0, "batch": 1, "none": 2}
MAX_TILE = 1024  # rewards per tile


@triton.jit
def _combined_tile(rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """Returns (c [BLOCK_GROUPS, BLOCK_G] combined rewards (0 outside), sample index, valid
    mask, scored mask: valid and scored by at least one reward function)."""
    groups = g0 + tl.arange(0, BLOCK_GROUPS)[:, None]
    members = tl.arange(0, BLOCK_G)[None, :]
    valid = (groups < num_groups) & (members < G)
    sample = groups * G + members
    c = tl.zeros([BLOCK_GROUPS, BLOCK_G], tl.float32)
    scored = tl.zeros([BLOCK_GROUPS, BLOCK_G], tl.int1)
    for k in range(0, K):
        r = tl.load(rewards_ptr + sample * K + k, mask=valid, other=float("nan"))
        c += tl.where(r == r, r * tl.load(weights_ptr + k), 0.0)  # NaN (not scored) counts as 0, as nansum
        scored = scored | (r == r)
    return c, sample, valid, scored


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
    batch_std = 0.0
    if SCALE == 1:
        # Scalar running sums, each tile reduced at once: tile-shaped accumulators carried
        # across the loop spilled at BLOCK_GROUPS 64 x BLOCK_G 16 (sm_80).
        total = 0.0
        n_batch = 0.0
        for g0 in range(0, num_groups, BLOCK_GROUPS):
            c, sample, valid, scored = _combined_tile(
                rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS, BLOCK_G
            )
            total += tl.sum(tl.sum(tl.where(scored, c, 0.0), 1), 0)
            n_batch += tl.sum(tl.sum(tl.where(scored, 1.0, 0.0), 1), 0)
        batch_mean = total / tl.maximum(n_batch, 1.0)
        m2 = 0.0
        for g0 in range(0, num_groups, BLOCK_GROUPS):
            c, sample, valid, scored = _combined_tile(
                rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS, BLOCK_G
            )
            diff = tl.where(scored, c - batch_mean, 0.0)
            m2 += tl.sum(tl.sum(diff * diff, 1), 0)
        batch_std = tl.where(n_batch > 1, tl.sqrt(m2 / tl.maximum(n_batch - 1, 1.0)), float("nan"))
    zero_std = tl.zeros([BLOCK_GROUPS], tl.float32)
    for g0 in range(0, num_groups, BLOCK_GROUPS):
        c, sample, valid, scored = _combined_tile(rewards_ptr, weights_ptr, g0, num_groups, G, K, BLOCK_GROUPS, BLOCK_G)
        n = tl.sum(tl.where(scored, 1.0, 0.0), 1)
        mean = tl.where(n > 0, tl.sum(tl.where(scored, c, 0.0), 1) / tl.maximum(n, 1.0), float("nan"))
        centred = tl.where(scored, c - mean[:, None], 0.0)
        std = tl.where(n > 1, tl.sqrt(tl.sum(centred * centred, 1) / tl.maximum(n - 1, 1.0)), float("nan"))
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
        tl.store(combined_ptr + sample, tl.where(scored, c, float("nan")), mask=valid)
        tl.store(adv_ptr + sample, tl.where(scored & (adv == adv), adv, 0.0), mask=valid)
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
    """rewards [N] or [N, K] (arguments already validated; reward_weights a [K] tensor on
    the rewards' device), group size G -> GroupAdvantages, as ``reference.group_advantages``.
    ``block_groups`` (a power of two) sets the tile height."""
    r = rewards.float()
    r = (r.unsqueeze(1) if r.dim() == 1 else r).contiguous()  # [N, K]
    N, K = r.shape
    num_groups = N // G
    w = torch.ones(K, device=r.device) if reward_weights is None else reward_weights.float().contiguous()  # [K]
    adv = torch.empty(N, dtype=torch.float32, device=r.device)
    combined = torch.empty_like(adv)
    mean = torch.empty(num_groups, dtype=torch.float32, device=r.device)
    std = torch.empty_like(mean)
    frac_zero_std = torch.empty(1, dtype=torch.float32, device=r.device)
    block_g = triton.next_power_of_2(G)
    if block_groups is None:
        block_groups = max(1, min(triton.next_power_of_2(num_groups), MAX_TILE // block_g))
    with device_guard(rewards):
        _group_advantages_kernel[(1,)](
            r,
            w,
            adv,
            combined,
            mean,
            std,
            frac_zero_std,
            num_groups,
            G,
            K,
            float(eps),
            SCALE=SCALE_KINDS[scale],
            BLOCK_GROUPS=block_groups,
            BLOCK_G=block_g,
        )
    return GroupAdvantages(adv, combined, mean, std, frac_zero_std.reshape(()))
