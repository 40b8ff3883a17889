"""grpo_loss: the clipped GRPO loss (and its relatives) straight from the logits.

Two paths. On CUDA with token-level ratios, one Triton launch computes the loss, the
metrics and dL/dlogits together (:class:`FusedGradFunction` attaches that gradient, which
backward only rescales). Otherwise the vocabulary-sized work is :class:`TokenLogprobsFunction`
(one chunked or Triton pass forward, one backward, no [B, T, V] float32 temporaries) and the
per-token policy math runs on the flat [B * T] tokens (``ops/policy.py``), which costs nothing next
to the vocabulary sweep. Every option and per-loss-type rule comes from the loss spec
(``grpo_fast/spec.py``).
"""

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.ops._validate import check_ids, check_tensor, loss_options
from grpo_fast.ops.policy import LossInputs, PolicyBatch
from grpo_fast.ops.token_logprobs import TokenLogprobsFunction
from grpo_fast.outputs import LossOutput
from grpo_fast.spec import LossConfig, accumulate_dtype


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


def _one_launch(logits, ids, batch: PolicyBatch, config: LossConfig, return_entropy, inplace_backward, launch):
    """The token-level loss in one Triton launch (``kernels/grpo_loss.py``).

    The gradient is computed in the forward when ``logits.requires_grad`` under grad mode,
    into a new [B, T, V] buffer or, with ``inplace_backward``, into the logits themselves
    (their values are destroyed by the forward, not the backward). Backward runs once.
    """
    from grpo_fast.kernels.grpo_loss import grpo_loss_fwd

    write_grad = torch.is_grad_enabled() and logits.requires_grad
    grad = None
    if write_grad:
        grad = logits.detach() if inplace_backward else torch.empty_like(logits)
    with torch.no_grad():
        pieces = grpo_loss_fwd(logits.detach(), ids, batch, config, grad, return_entropy=return_entropy, **launch)
    # Every reduction in one call: the weighted loss terms, then the metrics' masked sums.
    sums = pieces.sum(dim=1)
    means = (sums[1:] / batch.mask.sum().clamp(min=1.0)).float()
    out = LossOutput(
        loss=sums[0],
        kl=None if batch.ref is None else means[0],
        clip_ratio_low=means[1],
        clip_ratio_high=means[2],
        clip_ratio_region=means[3],
        ratio_mean=means[4],
        entropy=means[5] if return_entropy else None,
    )
    return out._replace(loss=FusedGradFunction.apply(logits, out.loss, grad)) if write_grad else out


@loss_options
def grpo_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    num_items_in_batch=None,
    importance_weights: torch.Tensor | None = None,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    launch: dict | None = None,
    loss_config: LossConfig | None = None,
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
        num_items_in_batch: the dapo/cispo normaliser: the active-token count of the whole
            batch across micro-batches and ranks (int or scalar tensor, 0 counts as 1);
            None = this batch's count.
        importance_weights: [B] or [B, T] multipliers of the policy term (e.g. a rollout
            engine's truncated importance ratio).
        return_entropy: also average the per-token entropy into ``LossOutput.entropy``.
        inplace_backward: write dL/dlogits into the logits buffer (see ``token_logprobs``).
        launch: Triton launch overrides ``{"block_v", "programs", "warps"}`` (benchmarks and
            tests): forces the one-launch kernel, whatever the device.
        loss_config: a :class:`grpo_fast.LossConfig` holding the options below, built once
            (instead of the keywords).
        {loss_options}

    Returns:
        :class:`LossOutput` ``(loss, kl, clip_ratio_low, clip_ratio_high, clip_ratio_region,
        ratio_mean, entropy)``: ``loss`` is the scalar to backpropagate, the rest detached.

    Example:
        >>> out = grpo_loss(logits[:, prompt_len - 1 : -1], completion_ids, advantages,
        ...                 completion_mask, beta=0.04, ref_logprobs=ref_logp)
        >>> out.loss.backward()
    """
    config = loss_config
    check_tensor("logits", logits, 3)
    B, T, V = logits.shape
    check_ids(ids, (B, T), V)
    inputs = LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch)
    inputs.check((B, T), config)
    backend = "triton" if launch is not None else select_backend(logits)
    if backend == "reference":
        return inputs.run_reference(reference.grpo_loss, logits, ids, config=config, return_entropy=return_entropy)
    batch = PolicyBatch.prepare(config, (B, T), accumulate_dtype(logits), logits.device, inputs)
    one_launch = config.importance_sampling == "token" and config.kind.kernel_kind is not None
    if backend == "triton" and one_launch:
        return _one_launch(logits, ids, batch, config, return_entropy, inplace_backward, launch or {})
    if launch is not None:
        raise ValueError(
            "launch: the one-launch Triton kernel runs token-level ratios of the loss types it implements, got "
            f"importance_sampling={config.importance_sampling!r}, loss_type={config.loss_type!r}"
        )
    out = TokenLogprobsFunction.apply(logits, ids, float(config.temperature), return_entropy, inplace_backward, backend)
    logp, entropy = out if return_entropy else (out, None)
    return batch.loss(logp.reshape(-1), config, None if entropy is None else entropy.reshape(-1))
