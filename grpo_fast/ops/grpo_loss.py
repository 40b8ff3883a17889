"""grpo_loss: the clipped GRPO loss (and its relatives) straight from the logits.

Two paths. On CUDA with token-level ratios, one Triton launch computes the loss, the
metrics and dL/dlogits together (:class:`FusedGradFunction` attaches that gradient, which
backward only rescales). Otherwise the vocabulary-sized work is :class:`TokenLogprobsFunction`
(one chunked or Triton pass forward, one backward, no [B, T, V] float32 temporaries) and the
per-token policy math runs on [B, T] tensors with ``reference.policy_loss``, the spec itself,
since at [B, T] it costs nothing next to the vocabulary sweep.
"""

from typing import Optional

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.ops._validate import check_ids, check_loss_options, check_temperature, check_tensor
from grpo_fast.ops.token_logprobs import TokenLogprobsFunction
from grpo_fast.outputs import LossOutput


class FusedGradFunction(torch.autograd.Function):
    """Attaches dL/dlogits, already written by the forward kernel, to the loss value."""

    @staticmethod
    def forward(ctx, logits, loss, grad):
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        from grpo_fast.kernels.grpo_loss import scale_grad_

        return scale_grad_(grad, grad_loss), None, None


def fused_grpo_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    block_v: Optional[int] = None,
    programs: Optional[int] = None,
    warps: Optional[int] = None,
    **options,
) -> LossOutput:
    """``grpo_loss`` for ``importance_sampling="token"`` in one Triton launch (arguments
    already validated; ``options`` are the policy-loss keywords of ``grpo_loss``; ``block_v``,
    ``programs`` and ``warps`` are launch knobs of ``kernels.grpo_loss.grpo_loss_fwd``).

    The gradient is computed in the forward when ``logits.requires_grad`` under grad mode,
    into a new [B, T, V] buffer or, with ``inplace_backward``, into the logits themselves
    (their values are destroyed by the forward, not the backward). Backward runs once.
    """
    if options.get("importance_sampling", "token") != "token":
        raise ValueError("the fused Triton loss is token-level; sequence-level ratios take the two-pass path")
    write_grad = torch.is_grad_enabled() and logits.requires_grad
    grad = None
    if write_grad:
        grad = logits.detach() if inplace_backward else torch.empty_like(logits)
    from grpo_fast.kernels.grpo_loss import grpo_loss_fwd

    kernel_options = {k: v for k, v in options.items() if k != "importance_sampling"}
    with torch.no_grad():
        out = grpo_loss_fwd(
            logits.detach(), ids, advantages, mask, old_logprobs, ref_logprobs, grad,
            temperature=temperature, return_entropy=return_entropy, block_v=block_v, programs=programs, warps=warps,
            **kernel_options,
        )  # fmt: skip
    if not write_grad:
        return out
    return out._replace(loss=FusedGradFunction.apply(logits, out.loss, grad))


def grpo_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    delta: Optional[float] = None,
    temperature: float = 1.0,
    loss_type: str = "grpo",
    importance_sampling: str = "token",
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    importance_weights: Optional[torch.Tensor] = None,
    dual_clip: Optional[float] = None,
    kl_estimator: str = "k3",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    return_entropy: bool = False,
    inplace_backward: bool = False,
) -> LossOutput:
    """The GRPO policy loss over completion tokens, with TRL's semantics.

    Args:
        logits: [B, T, V] fp16/bf16/fp32/fp64, any strides; position t predicts ``ids[:, t]``.
        ids: [B, T] integer completion tokens in [0, V).
        advantages: [B] per sequence or [B, T] per token.
        mask: [B, T] 1 for completion tokens, 0 for padding (None: all ones). Rows may be empty.
        old_logprobs: [B, T] log-probs of the sampling policy; None = on-policy (ratio 1,
            the gradient still flows).
        ref_logprobs: [B, T] log-probs of the reference model; required when ``beta != 0``.
        beta: weight of the KL penalty ``kl_estimator`` (k3 by default, DeepSeekMath).
        eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high]; ``eps_high=None`` means
            eps_low. For ``cispo`` eps_high is the cap of the truncated ratio (e.g. 5.0).
        delta: upper bound of the unclipped ratio (two-sided clipping), > 1, or None.
        temperature: > 0, applied to the logits before the softmax.
        loss_type: grpo | bnpo | dr_grpo | dapo | luspo | cispo | sapo (see DESIGN.md).
        importance_sampling: "token" or "sequence" (GSPO: one length-normalised ratio per row).
        max_completion_length: required for dr_grpo (the loss is divided by B * it).
        num_items_in_batch: dapo/cispo normaliser: the active-token count of the whole batch
            across micro-batches and ranks (int or scalar tensor); None = this batch's count.
        importance_weights: [B] or [B, T] multipliers of the policy term (e.g. a rollout
            engine's truncated importance ratio).
        dual_clip: c > 1; where A < 0 the policy term is capped at -A * c (verl, OpenRLHF).
        kl_estimator: "k3" (exp(d) - d - 1), "k1" (-d) or "k2" (d^2 / 2), d = ref - logp.
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for A > 0 and A <= 0.
        return_entropy: also average the per-token entropy into ``LossOutput.entropy``.
        inplace_backward: write dL/dlogits into the logits buffer (see ``token_logprobs``).

    Returns:
        :class:`LossOutput` ``(loss, kl, clip_ratio_low, clip_ratio_high, clip_ratio_region,
        ratio_mean, entropy)``: ``loss`` is the scalar to backpropagate, the rest detached.

    Example:
        >>> out = grpo_loss(logits[:, prompt_len - 1 : -1], completion_ids, advantages,
        ...                 completion_mask, beta=0.04, ref_logprobs=ref_logp)
        >>> out.loss.backward()
    """
    check_tensor("logits", logits, 3)
    B, T, V = logits.shape
    check_ids(ids, (B, T), V)
    check_temperature(temperature)
    options = dict(
        beta=beta,
        eps_low=eps_low,
        eps_high=eps_high,
        delta=delta,
        loss_type=loss_type,
        importance_sampling=importance_sampling,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
        importance_weights=importance_weights,
        dual_clip=dual_clip,
        kl_estimator=kl_estimator,
        sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg,
    )
    check_loss_options(B, T, advantages, mask, old_logprobs, ref_logprobs, **options)
    backend = select_backend(logits)
    if backend == "reference":
        return reference.grpo_loss(
            logits, ids, advantages, mask, old_logprobs, ref_logprobs,
            temperature=temperature, return_entropy=return_entropy, **options,
        )  # fmt: skip
    if backend == "triton" and importance_sampling == "token":
        return fused_grpo_loss(
            logits, ids, advantages, mask, old_logprobs, ref_logprobs,
            temperature=temperature, return_entropy=return_entropy, inplace_backward=inplace_backward, **options,
        )  # fmt: skip
    out = TokenLogprobsFunction.apply(logits, ids, float(temperature), return_entropy, inplace_backward, backend)
    logp, entropy = out if return_entropy else (out, None)
    return reference.policy_loss(logp, advantages, mask, old_logprobs, ref_logprobs, entropy=entropy, **options)
