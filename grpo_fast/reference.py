"""The eager PyTorch reference: the readable spec of every op in grpo_fast.

Everything here is plain PyTorch in float32 (float64 if given float64), written to be read,
not to be fast: it materialises ``[B, T, V]`` temporaries freely. Tests and benchmarks
compare every backend against these functions. Production code calls only
``group_advantages`` (the CPU path: O(N) rewards, the spec is fast enough) and the forced
``GRPO_FAST_BACKEND=reference``; the policy math it runs lives in ``grpo_fast/ops/``. Where
TRL's ``GRPOTrainer`` has an option, the numbers here are TRL's (``_compute_loss`` and
``_generate_and_score_completions``); the other options follow their papers (DAPO,
Dr. GRPO, GSPO, CISPO, SAPO, verl's dual clip). What varies by loss type (the policy term,
the aggregation, the clip metrics) is read from the loss spec, ``grpo_fast/spec.py``.
"""

import torch

from grpo_fast.outputs import GroupAdvantages, LossOutput
from grpo_fast.spec import (
    IMPORTANCE_LEVELS,
    LossConfig,
    accumulate_dtype,
    loss_metrics,
    per_token_loss,
    without_padding,
)


def nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """Unbiased (Bessel) std over the values of ``x`` that are not NaN; NaN with fewer than two."""
    count = (~x.isnan()).sum(dim=dim)
    mean = x.nanmean(dim=dim, keepdim=dim is not None)
    var = ((x - mean) ** 2).nansum(dim=dim) / (count - 1).clamp(min=1)
    return torch.where(count > 1, var.sqrt(), torch.full_like(var, float("nan")))


def group_advantages(rewards, group_size=None, *, scale="group", eps=1e-4, reward_weights=None) -> GroupAdvantages:
    """Group-relative advantages, as TRL computes them.

    rewards: [N] with ``group_size``; [num_groups, G] without; [N, K] (one column per reward
    function) with ``group_size``. NaN means "not scored": it counts as 0 in the weighted sum
    over functions, and a completion no function scored is left out of its group's mean and
    std and gets advantage 0.
    """
    r = rewards.float()
    if r.dim() == 2 and group_size is None:  # [num_groups, G]
        group_size = r.shape[1]
        r = r.reshape(-1, 1)
    elif r.dim() == 1:
        r = r.unsqueeze(1)
    w = torch.ones(r.shape[1]) if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float32)
    unscored = r.isnan().all(dim=1)  # [N]
    combined = (r * w.to(r.device)).nansum(dim=1).masked_fill(unscored, float("nan"))  # [N]
    grouped = combined.view(-1, group_size)  # [num_groups, G]
    mean = grouped.nanmean(dim=1)
    std = nanstd(grouped, dim=1)
    centred = combined - mean.repeat_interleave(group_size)
    if scale == "group":
        adv = centred / (std.repeat_interleave(group_size) + eps)
    elif scale == "batch":
        adv = centred / (nanstd(combined) + eps)
    else:
        adv = centred
    frac_zero_std = torch.isclose(std, torch.zeros_like(std)).float().mean()
    return GroupAdvantages(adv.nan_to_num(nan=0.0), combined, mean, std, frac_zero_std)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0, return_entropy: bool = False):
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
    mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    num_items_in_batch=None,
    importance_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    **options,
) -> LossOutput:
    """The GRPO family of losses from per-token log-probs ``logp`` [B, T] (differentiable).

    ``options`` are the fields of :class:`grpo_fast.LossConfig`; see :func:`grpo_fast.grpo_loss`
    for the rest. ``entropy`` [B, T] is only averaged for logging.
    """
    c = LossConfig(**options)
    B, T = logp.shape
    m = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    old = logp.detach() if old_logprobs is None else old_logprobs.to(logp.dtype)
    iw = None if importance_weights is None else importance_weights.to(logp.dtype)
    iw = iw.unsqueeze(1) if iw is not None and iw.dim() == 1 else iw
    ref = None if ref_logprobs is None else ref_logprobs.to(logp.dtype)
    # padded positions count for nothing, whatever they hold
    logp_, old, ref, adv, iw = without_padding(m, logp, old, ref, adv, iw)

    w = torch.exp(IMPORTANCE_LEVELS[c.importance_sampling](logp_ - old, m))  # [B, T], or [B, 1] for GSPO
    per_token, kl = per_token_loss(w, logp_, adv, ref, iw, c)
    loss = (
        per_token.expand(B, T) * c.aggregation.token_weights(m, m.sum(-1, keepdim=True), B, c, num_items_in_batch)
    ).sum()
    return LossOutput(loss=loss, **loss_metrics(w, adv, kl, entropy, m, c))


def grpo_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    return_entropy: bool = False,
    **options,
) -> LossOutput:
    """The GRPO loss from full logits [B, T, V]: token_logprobs, then policy_loss."""
    temperature = options.get("temperature", 1.0)
    out = token_logprobs(logits, ids, temperature=temperature, return_entropy=return_entropy)
    logp, entropy = out if return_entropy else (out, None)
    return policy_loss(logp, advantages, mask, old_logprobs, ref_logprobs, entropy=entropy, **options)
