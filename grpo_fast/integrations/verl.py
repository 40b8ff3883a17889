"""grpo_fast inside verl (0.9): policy losses in verl's registry, and the fused LM head as verl's
``FusedLinearForPPO``. Importing this module does both, in the process that imports it; verl
imports it in every worker with

    VERL_USE_EXTERNAL_MODULES=grpo_fast.integrations.verl python -m verl.trainer.main_ppo \\
        actor_rollout_ref.actor.policy_loss.loss_mode=grpo_fast_vanilla \\
        actor_rollout_ref.model.use_fused_kernels=True ...

**Policy losses** ``grpo_fast_vanilla``, ``grpo_fast_gspo``, ``grpo_fast_cispo`` and
``grpo_fast_sapo`` take verl's arguments (log-probs [B, T], advantages [B, T], response mask,
``loss_agg_mode``, the actor config, rollout importance weights), return verl's
``(loss, metrics)`` and equal verl's ``vanilla``, ``gspo``, ``cispo`` and ``sapo``. The
per-token math is grpo_fast's (``ops/policy.py`` reading the loss spec); verl's choices are
mapped onto it:

- verl's ``loss_agg_mode`` becomes the token weights dL/dper_token (:func:`verl_token_weights`):
  ``token-mean`` m / N, ``token-sum`` m, ``seq-mean-token-sum`` m / S,
  ``seq-mean-token-sum-norm`` m / (S * loss_scale_factor), ``seq-mean-token-mean``
  m / (row length * S); N and S are the global token and non-empty-sequence counts of
  ``config.global_batch_info`` (this batch's when absent), all times ``dp_size``. sapo always
  aggregates ``seq-mean-token-mean``, as in verl.
- vanilla: the clipped term with ``dual_clip = clip_ratio_c``; verl clamps the log-ratio to
  [-20, 20] (vanilla, cispo, sapo): there the ratio is computed from the clamped log-ratio
  (no gradient), as in verl.
- gspo: sequence-level ratios. verl builds a per-token ratio whose gradient goes to each
  token while grpo_fast's sequence ratio spreads it over the row; the two gradients agree
  because every aggregation weighs a row's tokens alike. They do not when rollout weights
  vary within a sequence, nor where verl caps a sequence's log-ratio at 10: such a batch runs
  verl's own function (with one warning).
- cispo: verl clamps the detached ratio to [1 - clip_ratio_low, 1 + clip_ratio_high] where
  CISPO's paper (and grpo_fast, TRL) only caps it: the cap is ``eps_high = 1 + clip_ratio_high``
  and the lower bound a detached importance weight ``max(1, (1 - clip_ratio_low) / ratio)``.

**Fused LM head**: :class:`FusedLinearForPPO` replaces
``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (which verl's model forwards
import when ``use_fused_kernels`` is set): the same log-probs (float32) and entropies (the
hidden dtype) from the last hidden states and the LM-head weight, in one sweep of
:func:`grpo_fast.fused_linear_token_logprobs`, whose backward gives the log-probs' gradient
(one more sweep, never [chunk, V] float32 temporaries beyond one chunk of logits). An
entropy gradient (``entropy_coeff != 0``) is verl's own computation, added to ours.
"""

import warnings

import torch
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.utils.experimental import torch_functional as verl_fused
from verl.workers.config import ActorConfig

from grpo_fast.ops import fused_linear_token_logprobs
from grpo_fast.ops.policy import PolicyBatch, Sequences
from grpo_fast.spec import IMPORTANCE_LEVELS, LossConfig, clipped_term

LOG_RATIO_BOUND = 20.0  # verl clamps log(pi / pi_old) to [-20, 20] (vanilla, cispo, sapo)
SEQUENCE_LOG_RATIO_CAP = 10.0  # verl's gspo caps the sequence log-ratio at 10
VERL_FUSED_LINEAR_FOR_PPO = verl_fused.FusedLinearForPPO  # verl's own, before this module replaced it
_warned = set()


def verl_token_weights(
    mask, loss_agg_mode: str, dp_size: int = 1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
) -> torch.Tensor:
    """dL/dper_token [B, T] of verl's ``agg_loss(loss_mat, mask, loss_agg_mode, **global_batch_info)``
    (the aggregation is linear in the per-token losses, so it is these weights)."""
    m = mask.to(torch.float32)
    row_len = m.sum(-1, keepdim=True)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("batch_num_tokens (the global token count) is required when dp_size > 1")
        return m * dp_size / (m.sum() if batch_num_tokens is None else batch_num_tokens)
    if loss_agg_mode == "token-sum":
        return m * dp_size
    if loss_agg_mode not in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        raise ValueError(f"loss_agg_mode must be one of verl's aggregation modes, got {loss_agg_mode!r}")
    if global_batch_size is None and dp_size > 1:
        raise ValueError("global_batch_size (the global sequence count) is required when dp_size > 1")
    sequences = (row_len > 0).sum() if global_batch_size is None else global_batch_size  # empty rows do not count
    if loss_agg_mode == "seq-mean-token-mean":
        return m / (row_len + 1e-8) * dp_size / sequences  # verl's row mean: length + 1e-8
    weights = m * dp_size / sequences
    if loss_agg_mode == "seq-mean-token-sum-norm":
        weights = weights / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return weights


def _clip_bounds(config: ActorConfig):
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _clamped_log_ratio_logp(logp, old):
    """logp, except where verl clamps ``logp - old`` to [-20, 20]: there ``old +- 20`` (no gradient)."""
    log_ratio = logp - old
    bound = LOG_RATIO_BOUND
    return torch.where(log_ratio.abs() > bound, old + log_ratio.clamp(-bound, bound), logp)


def _loss(loss_config: LossConfig, logp, old, advantages, mask, weights, importance_weights):
    """(loss, ratio w, token mask) by grpo_fast's per-token math with verl's token weights."""
    B, T = logp.shape
    m = mask.to(logp.dtype)

    def flat(x):
        return None if x is None else x.to(logp.dtype).expand(B, T).reshape(-1)

    batch = PolicyBatch(
        flat(m),
        flat(weights),
        flat(advantages),
        flat(importance_weights),
        flat(old.detach()),
        None,
        Sequences.grid(B, T, logp.device),
        None,
    )
    ev = batch.evaluate(logp.reshape(-1), loss_config)
    w = ev.w.view(B, T) if ev.w_seq is None else ev.w_seq.unsqueeze(1)
    return ev.terms.sum(), w, m


def _metrics(clipfrac, ppo_kl, clipfrac_lower=0.0) -> dict:
    """verl's three policy-loss metrics, as Python floats."""
    names = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
    return {name: float(value) for name, value in zip(names, (clipfrac, ppo_kl, clipfrac_lower))}


@core_algos.register_policy_loss("grpo_fast_vanilla")
def policy_loss_vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """verl's ``vanilla`` (PPO clip, dual clip ``clip_ratio_c`` where A < 0) by grpo_fast."""
    low, high = _clip_bounds(config)
    clip_c = config.get("clip_ratio_c", 3.0)
    loss_config = LossConfig(eps_low=low, eps_high=high, dual_clip=clip_c)
    logp = _clamped_log_ratio_logp(log_prob, old_log_prob)
    weights = verl_token_weights(response_mask, loss_agg_mode, **config.global_batch_info)
    loss, w, m = _loss(loss_config, logp, old_log_prob, advantages, response_mask, weights, rollout_is_weights)
    with torch.no_grad():
        below, above = loss_config.kind.clip_flags(w, advantages, loss_config)
        before_dual = clipped_term(w, logp, advantages, LossConfig(eps_low=low, eps_high=high))
        dual = (before_dual > -advantages * clip_c) & (advantages < 0)  # the dual clip binds
        metrics = _metrics(
            verl_F.masked_mean((below | above).to(m.dtype), m),
            verl_F.masked_mean(old_log_prob - logp, m),
            verl_F.masked_mean(dual.to(m.dtype), m),
        )
    return loss, metrics


@core_algos.register_policy_loss("grpo_fast_gspo")
def policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``gspo`` (sequence-level ratio, PPO clip) by grpo_fast's sequence-level ratios."""
    m = response_mask.to(log_prob.dtype)
    with torch.no_grad():
        seq_log_ratio = IMPORTANCE_LEVELS["sequence"](log_prob - old_log_prob, m)  # [B, 1]
        row_weights = rollout_is_weights is not None and bool(
            ((rollout_is_weights - rollout_is_weights[:, :1]).abs() * m).sum() > 0
        )
    if row_weights or bool((seq_log_ratio > SEQUENCE_LOG_RATIO_CAP).any()):
        reason = "rollout weights that vary within a sequence" if row_weights else "a sequence log-ratio above 10"
        return _verl_own(
            "gspo", reason, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )
    low, high = _clip_bounds(config)
    loss_config = LossConfig(eps_low=low, eps_high=high, importance_sampling="sequence")
    weights = verl_token_weights(response_mask, loss_agg_mode, **config.global_batch_info)
    loss, w, m = _loss(loss_config, log_prob, old_log_prob, advantages, response_mask, weights, rollout_is_weights)
    with torch.no_grad():
        below, above = loss_config.kind.clip_flags(w, advantages, loss_config)
        metrics = _metrics(
            verl_F.masked_mean((below | above).to(m.dtype), m), verl_F.masked_mean(old_log_prob - log_prob, m)
        )
    return loss, metrics


@core_algos.register_policy_loss("grpo_fast_cispo")
def policy_loss_cispo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """verl's ``cispo`` (detached ratio clamped to [1 - low, 1 + high], times A log pi) by grpo_fast."""
    low, high = _clip_bounds(config)
    loss_config = LossConfig(loss_type="cispo", eps_high=1 + high)
    with torch.no_grad():
        # verl's lower clamp, as a weight on grpo_fast's (unclamped) ratio: w * (1 - low) / w where w < 1 - low
        lower_bound = ((1 - low) / torch.exp(log_prob - old_log_prob)).clamp(min=1.0)
    weights_in = lower_bound if rollout_is_weights is None else lower_bound * rollout_is_weights
    weights = verl_token_weights(response_mask, loss_agg_mode, **config.global_batch_info)
    loss, _, m = _loss(loss_config, log_prob, old_log_prob, advantages, response_mask, weights, weights_in)
    with torch.no_grad():
        log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        clipped = (log_ratio.exp() < 1 - low) | (log_ratio.exp() > 1 + high)
        metrics = _metrics(verl_F.masked_mean(clipped.to(m.dtype), m), verl_F.masked_mean(-log_ratio, m))
    return loss, metrics


@core_algos.register_policy_loss("grpo_fast_sapo")
def policy_loss_sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``sapo`` (soft gate, temperatures tau_pos / tau_neg) by grpo_fast; always seq-mean-token-mean."""
    loss_config = LossConfig(loss_type="sapo", sapo_tau_pos=config.tau_pos, sapo_tau_neg=config.tau_neg)
    logp = _clamped_log_ratio_logp(log_prob, old_log_prob)
    weights = verl_token_weights(response_mask, "seq-mean-token-mean", **config.global_batch_info)
    loss, _, m = _loss(loss_config, logp, old_log_prob, advantages, response_mask, weights, rollout_is_weights)
    return loss, _metrics(0.0, verl_F.masked_mean(old_log_prob - logp.detach(), m))


def _verl_own(name, reason, *args):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"grpo_fast_{name}: {reason}; verl's own {name} computes this batch", stacklevel=3)
    return core_algos.get_policy_loss_fn(name)(*args)


class _VerlEntropyGradient(torch.autograd.Function):
    """Passes ``entropy`` (computed by grpo_fast's sweep) through; its gradient with respect to
    hidden and weight is verl's own computation."""

    @staticmethod
    def forward(ctx, entropy, hidden, weight, ids, temperature, chunk_size):
        ctx.save_for_backward(hidden, weight, ids)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy):
        hidden, weight, ids = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(need) for x, need in zip((hidden, weight), ctx.needs_input_grad[1:3])]
        wanted = [x for x in inputs if x.requires_grad]
        grads = [None, None]
        if wanted:
            with torch.enable_grad():
                _, entropy = verl_fused.FusedLinearForPPOFunction.apply(*inputs, ids, ctx.temperature, ctx.chunk_size)
                computed = iter(torch.autograd.grad((entropy * grad_entropy).sum(), wanted))
            grads = [next(computed) if x.requires_grad else None for x in inputs]
        return None, grads[0], grads[1], None, None, None


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` (same constructor and forward) on grpo_fast's fused LM head.

    ``forward(hidden_states [B, T, H] or [N, H], vocab_weights [V, H], input_ids, temperature)``
    returns ``(log_probs, entropy)`` of ``input_ids``'s shape: log-probs in float32, entropies in
    the hidden dtype, both differentiable. ``chunk_size`` is only used by verl's entropy
    gradient; ``impl_backend`` ("torch" or "liger") is accepted and has no effect.
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"impl_backend must be 'torch' or 'liger' (verl's choices), got {impl_backend!r}")
        self.chunk_size = chunk_size

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        ids = input_ids.to(torch.int64)
        logp, entropy = fused_linear_token_logprobs(
            hidden_states, vocab_weights, ids, temperature=temperature, return_entropy=True
        )
        entropy = entropy.to(hidden_states.dtype)
        if torch.is_grad_enabled() and (hidden_states.requires_grad or vocab_weights.requires_grad):
            entropy = _VerlEntropyGradient.apply(
                entropy, hidden_states, vocab_weights, ids, temperature, self.chunk_size
            )
        return logp.float(), entropy


verl_fused.FusedLinearForPPO = FusedLinearForPPO
