"""fused_linear_token_logprobs: per-token log-probs from the last hidden states and the LM head,
without ever holding the [B, T, V] logits; differentiable.

Order: the autograd.Function, the public function; the chunk steps are those of
``fused_linear_grpo_loss`` (one chunk of logits at a time, the token_logprobs kernels on it).
The forward sweeps the vocabulary once and keeps the per-token log-sum-exp; the backward,
given g = dL/dlogp, sweeps again and recomputes each chunk's logits z = h @ W.T + bias:

    dL/dz = g * (onehot(ids) - softmax(z / tau)) / tau,   dL/dh = dL/dz @ W,
    dL/dW = sum over chunks of dL/dz.T @ h,                dL/dbias = sum over chunks of dL/dz

Tokens whose g is 0 still cost their matmuls: the caller passes only the tokens it needs.
"""

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.ops.fused_linear_grpo_loss import (
    _chunk_backward,
    _chunk_logits,
    _chunk_rows,
    _chunks,
    _grad_buffers,
    _logprobs_sweep,
    check_linear,
)
from grpo_fast.ops.token_logprobs import _kernels


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] or None, ids [N]) -> (logp [N], entropy [N] or None)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, return_entropy, rows, fp32_weight_grad, backend):
        logp, lse, entropy = _logprobs_sweep(hidden, weight, bias, ids, temperature, rows, backend, return_entropy)
        ctx.save_for_backward(hidden, weight, bias, ids, lse)
        ctx.temperature, ctx.rows, ctx.fp32_weight_grad, ctx.backend = temperature, rows, fp32_weight_grad, backend
        if entropy is None:
            return logp
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, *unused_grad_entropy):
        hidden, weight, bias, ids, lse = ctx.saved_tensors
        wanted = tuple(ctx.needs_input_grad[:3])
        grads = _grad_buffers(hidden, weight, bias, wanted, ctx.fp32_weight_grad)
        if grad_logp is not None and any(wanted):
            _, bwd = _kernels(ctx.backend)
            for r in _chunks(hidden.shape[0], ctx.rows):
                z = _chunk_logits(hidden[r], weight, bias)
                _chunk_backward(z, ids[r], lse[r], grad_logp[r], ctx.temperature, hidden[r], weight, bwd, grads, r)
        elif grads[0] is not None:
            grads[0].zero_()  # no gradient reached the log-probs
        grad_hidden, grad_weight, grad_bias = grads
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def fused_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = True,
):
    """Per-token log-probs of ``ids`` under the LM head, ``log_softmax((hidden @ weight.T + bias) / temperature)``
    gathered at ``ids``, without holding the [B, T, V] logits; differentiable with respect to
    hidden, weight and bias (the backward sweeps the vocabulary again, chunk by chunk).

    Args:
        hidden: [B, T, H] (or flat [N, H]) last hidden states, fp16/bf16/fp32/fp64; position
            t predicts ``ids[:, t]``.
        weight: [V, H] LM-head weight, the dtype of ``hidden``.
        ids: [B, T] (or [N]) integer token ids in [0, V).
        bias: [V] or None.
        temperature: > 0; the logits are divided by it before the softmax.
        return_entropy: also return the per-token entropy (no gradient).
        chunk_size: token rows per chunk (default: a fixed byte budget for the chunk's logits).
        fp32_weight_grad: accumulate the weight gradient over chunks in float32 when the
            weight is fp16/bf16 (then cast to the weight's dtype).

    Returns:
        logp of ``ids``' shape, float32 (float64 for float64 inputs); with ``return_entropy``,
        ``(logp, entropy)``.

    Example:
        >>> hidden = ref_model.model(input_ids).last_hidden_state[:, prompt_len - 1 : -1]
        >>> ref_logp = fused_linear_token_logprobs(hidden, ref_model.lm_head.weight, completion_ids)
    """
    flat = hidden.dim() == 2
    check_linear(hidden, weight, bias, ids, temperature, chunk_size, flat=flat)
    H, V = hidden.shape[-1], weight.shape[0]
    N = ids.numel()
    backend = select_backend(hidden)
    if backend == "reference":
        logits = _chunk_logits(hidden.reshape(N, H), weight, bias).view(1, N, V)
        out = reference.token_logprobs(
            logits, ids.reshape(1, N), temperature=temperature, return_entropy=return_entropy
        )
        return tuple(x.view(ids.shape) for x in out) if return_entropy else out.view(ids.shape)
    rows = _chunk_rows(N, V, hidden.element_size(), hidden.device, chunk_size)
    out = FusedLinearLogprobsFunction.apply(
        hidden.reshape(N, H),
        weight,
        bias,
        ids.reshape(N),
        float(temperature),
        return_entropy,
        rows,
        fp32_weight_grad,
        backend,
    )
    return tuple(x.view(ids.shape) for x in out) if return_entropy else out.view(ids.shape)
