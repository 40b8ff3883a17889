"""The eager PyTorch reference: the readable spec of every op in grpo_fast.

Everything here is plain PyTorch in float32 (float64 if given float64), written to be read,
not to be fast: it materialises ``[B, T, V]`` temporaries freely. Tests and benchmarks
compare every backend against these functions. Where TRL's ``GRPOTrainer`` has an option,
the numbers here are TRL's (see ``GRPOTrainer._compute_loss``); the other options follow
their papers (DAPO, Dr. GRPO, GSPO, CISPO, SAPO, verl's dual clip).

The vocabulary-sized work (``token_logprobs``) is separate from the per-token policy math
(``policy_loss``), which works on ``[B, T]`` tensors only; the fused backends compute the
log-probs their own way and share nothing with this file but its outputs.
"""

from typing import Optional

import torch

from grpo_fast.outputs import GroupAdvantages, LossOutput

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCALES = ("group", "batch", "none")


def accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype every op computes in: float64 for float64 inputs, float32 for the rest."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def group_advantages(
    rewards: torch.Tensor,
    group_size: Optional[int] = None,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    reward_weights: Optional[torch.Tensor] = None,
) -> GroupAdvantages:
    """Group-relative advantages, as TRL computes them.

    rewards: [N] with ``group_size``; [num_groups, G] without; [N, K] (one column per reward
    function) with ``group_size``. NaN means "not scored" and counts as 0 in the weighted sum.
    """
    r = rewards.float()
    if r.dim() == 2 and group_size is None:  # [num_groups, G]
        group_size = r.shape[1]
        r = r.reshape(-1, 1)
    elif r.dim() == 1:
        r = r.unsqueeze(1)
    w = torch.ones(r.shape[1], device=r.device) if reward_weights is None else reward_weights.float()
    combined = (r * w).nansum(dim=1)  # [N]
    grouped = combined.view(-1, group_size)  # [num_groups, G]
    mean = grouped.mean(dim=1)
    std = grouped.std(dim=1)
    centred = combined - mean.repeat_interleave(group_size)
    if scale == "group":
        adv = centred / (std.repeat_interleave(group_size) + eps)
    elif scale == "batch":
        adv = centred / (combined.std() + eps)
    else:
        adv = centred
    frac_zero_std = torch.isclose(std, torch.zeros_like(std)).float().mean()
    return GroupAdvantages(adv, combined, mean, std, frac_zero_std)


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0, return_entropy: bool = False
):
    """log_softmax(logits / temperature) gathered at ids: [B, T, V], [B, T] -> [B, T] float32.

    With ``return_entropy`` also returns the per-token entropy [B, T] (detached).
    """
    logprobs_all = torch.log_softmax(logits.to(accumulate_dtype(logits)) / temperature, dim=-1)
    logp = logprobs_all.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logp, entropy.detach()


def policy_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    delta: Optional[float] = None,
    loss_type: str = "grpo",
    importance_sampling: str = "token",
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    importance_weights: Optional[torch.Tensor] = None,
    dual_clip: Optional[float] = None,
    kl_estimator: str = "k3",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    entropy: Optional[torch.Tensor] = None,
) -> LossOutput:
    """The GRPO family of losses from per-token log-probs ``logp`` [B, T] (differentiable).

    See :func:`grpo_loss` for the arguments; ``entropy`` [B, T] is only averaged for logging.
    """
    eps_high = eps_low if eps_high is None else eps_high
    B, T = logp.shape
    m = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    old = logp.detach() if old_logprobs is None else old_logprobs.to(logp.dtype)

    log_ratio = logp - old
    if importance_sampling == "sequence":  # GSPO: one ratio per sequence, [B, 1]
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    w = torch.exp(log_ratio)

    if loss_type == "cispo":
        pg = -torch.clamp(w, max=eps_high).detach() * adv * logp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, adv.new_tensor(sapo_tau_pos), adv.new_tensor(sapo_tau_neg))
        pg = -torch.sigmoid(tau * (w - 1)) * 4 / tau * adv
    else:
        w2 = torch.clamp(w, 1 - eps_low, 1 + eps_high)
        w1 = torch.clamp(w, max=delta) if delta is not None else w
        pg = -torch.min(w1 * adv, w2 * adv)
        if dual_clip is not None:
            pg = torch.where(adv < 0, torch.min(pg, -adv * dual_clip), pg)
    if importance_weights is not None:
        iw = importance_weights.to(logp.dtype)
        pg = pg * (iw.unsqueeze(1) if iw.dim() == 1 else iw)

    kl = None
    if ref_logprobs is not None:
        d = ref_logprobs.to(logp.dtype) - logp
        if kl_estimator == "k3":
            kl = torch.exp(d) - d - 1
        elif kl_estimator == "k1":
            kl = -d
        else:
            kl = d * d / 2
    per_token = pg + beta * kl if (beta != 0.0 and kl is not None) else pg
    per_token = per_token.expand(B, T)

    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (B * max_completion_length)
    elif loss_type in ("dapo", "cispo"):
        n = m.sum() if num_items_in_batch is None else num_items_in_batch
        loss = (per_token * m).sum() / n
    else:  # luspo
        loss = (per_token * m).sum(-1).mean()

    # Metrics, TRL's definitions: token-level values are averaged over active tokens,
    # sequence-level ratios ([B, 1]) over sequences.
    with torch.no_grad():
        n_active = m.sum().clamp(min=1.0)

        def batch_mean(x):  # [B, 1] at T = 1 is still token-level: masked tokens do not count
            return x.float().mean() if x.shape[1] == 1 and importance_sampling == "sequence" else (x * m).sum() / n_active

        if loss_type == "cispo":
            low = torch.zeros_like(w, dtype=torch.bool)
            high = (w > eps_high) & (adv > 0)
        else:
            low = (w < 1 - eps_low) & (adv < 0)
            high = (w > 1 + eps_high) & (adv > 0)
        metrics = dict(
            kl=None if kl is None else batch_mean(kl.detach()).float(),
            clip_ratio_low=batch_mean(low.to(m.dtype)).float(),
            clip_ratio_high=batch_mean(high.to(m.dtype)).float(),
            clip_ratio_region=batch_mean((low | high).to(m.dtype)).float(),
            ratio_mean=batch_mean(w.detach()).float(),
            entropy=None if entropy is None else batch_mean(entropy.to(m.dtype)).float(),
        )
    return LossOutput(loss=loss, **metrics)


def grpo_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    **options,
) -> LossOutput:
    """The GRPO loss from full logits [B, T, V]: token_logprobs, then policy_loss."""
    out = token_logprobs(logits, ids, temperature=temperature, return_entropy=return_entropy)
    logp, entropy = out if return_entropy else (out, None)
    return policy_loss(logp, advantages, mask, old_logprobs, ref_logprobs, entropy=entropy, **options)
