"""fused_linear_grpo_loss: the GRPO loss from the last hidden states and the LM head, without
ever holding the [B, T, V] logits; fused_linear_token_logprobs: the same sweep for log-probs only.

Order: the chunk steps, the autograd.Function, the public functions. The vocabulary-sized
work of a chunk is the token_logprobs kernels (Triton on CUDA, the chunked torch path on
CPU); the per-token policy math is ``ops/_policy.py``, as in grpo_loss.

For a chunk of n token rows h [n, H], with W [V, H], tau the temperature and g = dL/dlogp:

    z         = h @ W.T + bias                              [n, V], in the input dtype
    logp      = log_softmax(z / tau)[ids]                   [n], float32
    dL/dz     = g * (onehot(ids) - softmax(z / tau)) / tau  written over z
    dL/dh     = dL/dz @ W                                   [n, H]
    dL/dW    += dL/dz.T @ h                                 [V, H]
    dL/dbias += dL/dz.sum(0)                                [V]

With token-level ratios g at a token depends on that token's logp only (the normalisers
depend on the mask alone), so it is known as soon as its chunk's logp is: the forward sweeps
the vocabulary once, computing every gradient (three matmuls, as many as an eager forward
and backward), and the backward only scales them by dL/dloss. GSPO's sequence-level ratio
couples the tokens of a row: there the forward sweeps once for logp, forms g on the whole
[B, T] grid, and sweeps again, recomputing the logits, for the gradients (four matmuls).
"""

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.ops._policy import LossInputs, PolicyBatch, logp_grad, policy_loss
from grpo_fast.ops._validate import check_ids, check_temperature, check_tensor, loss_options
from grpo_fast.ops.token_logprobs import _kernels
from grpo_fast.outputs import LossOutput
from grpo_fast.spec import LossConfig, accumulate_dtype

# Bytes of one chunk's logits [n, V] by default. Every chunk re-reads and re-writes the
# [V, H] weight gradient, so chunks must be tall for the matmuls to run near peak; a GPU
# needs taller ones than a CPU. Either way it is a small, fixed fraction of [B*T, V].
CHUNK_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}


def _chunk_rows(N: int, V: int, itemsize: int, device: torch.device, chunk_size: int | None) -> int:
    """Token rows per chunk: ``chunk_size`` if given, else the byte budget split evenly over N."""
    if chunk_size is not None:
        return chunk_size
    rows = max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cpu"]) // (V * itemsize))
    n_chunks = max(1, -(-N // rows))
    return max(1, -(-N // n_chunks))  # equal chunks: no thin remainder that would run a slow matmul


def _chunks(N: int, rows: int):
    """Slices of consecutive token rows, ``rows`` at a time."""
    for r0 in range(0, N, rows):
        yield slice(r0, min(r0 + rows, N))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """h [n, H] -> z = h @ weight.T + bias, [n, V] in the input dtype."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, where acc may be float32 while a, b are 16-bit."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:  # cuBLAS multiplies 16-bit inputs into a float32 accumulator directly
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # no mixed-dtype matmul on CPU: upcast the chunk (bounded by the chunk size)
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _chunk_backward(z, ids, lse, g, temperature, h, weight, bwd, grads, rows) -> None:
    """Overwrites the chunk's logits z [n, V] with dL/dz and adds the chunk's share of the
    gradients into ``grads = (grad_hidden [N, H], grad_weight [V, H], grad_bias [V])``
    (None where not wanted)."""
    z3 = z.unsqueeze(0)
    bwd(z3, ids.unsqueeze(0), lse.unsqueeze(0), g.unsqueeze(0), temperature, z3)
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        torch.mm(z, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        _add_matmul_(grad_weight, z.t(), h)
    if grad_bias is not None:
        grad_bias += z.sum(0, dtype=grad_bias.dtype)


def _grad_buffers(hidden2d, weight, bias, wanted, fp32_weight_grad: bool):
    """Gradient buffers for the inputs flagged in ``wanted`` (hidden, weight, bias): hidden's
    is written chunk by chunk, the others accumulate from zero, in float32 for 16-bit weights
    when ``fp32_weight_grad`` and always for the bias (it is only [V])."""
    want_hidden, want_weight, want_bias = wanted
    weight_acc = torch.float32 if fp32_weight_grad and weight.dtype in (torch.float16, torch.bfloat16) else None
    return (
        torch.empty_like(hidden2d) if want_hidden else None,
        torch.zeros_like(weight, dtype=weight_acc) if want_weight else None,
        torch.zeros(bias.shape[0], dtype=torch.promote_types(bias.dtype, torch.float32), device=bias.device)
        if want_bias
        else None,
    )


def _logprobs_sweep(hidden2d, weight, bias, ids, temperature, rows, backend, return_entropy, on_chunk=None):
    """One pass over token chunks: logp [N] (float32; float64 for float64 inputs), lse [N],
    entropy [N] or None. ``on_chunk(z, rows, logp_rows, lse_rows)``, when given, runs on each
    chunk's logits z [n, V] as soon as its log-probs are known, and may overwrite z."""
    fwd, _ = _kernels(backend)
    N = hidden2d.shape[0]
    acc = accumulate_dtype(hidden2d)
    logp = torch.empty(N, dtype=acc, device=hidden2d.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if return_entropy else None
    for r in _chunks(N, rows):
        z = _chunk_logits(hidden2d[r], weight, bias)
        chunk_logp, chunk_lse, chunk_entropy = fwd(z.unsqueeze(0), ids[r].unsqueeze(0), temperature, return_entropy)
        logp[r], lse[r] = chunk_logp.view(-1), chunk_lse.view(-1)
        if return_entropy:
            entropy[r] = chunk_entropy.view(-1)
        if on_chunk is not None:
            on_chunk(z, r, logp[r], lse[r])
    return logp, lse, entropy


def _scatter(values: torch.Tensor, idx: torch.Tensor, N: int, compact: bool) -> torch.Tensor:
    """values [Na] of the active tokens at their flat positions idx of an [N] zero vector."""
    return values.new_zeros(N).index_copy_(0, idx, values) if compact else values


class FusedLinearGRPOFunction(torch.autograd.Function):
    """(hidden [B, T, H], weight [V, H], bias [V] or None) -> (loss, logp [B, T][, entropy]).

    ``batch`` and ``config`` are the loss's prepared per-token inputs and options
    (``ops/_policy.py``). The forward computes the gradients of the inputs flagged in
    ``wanted`` for dL/dloss = 1 (see the module docstring); the backward scales them by the
    incoming dL/dloss.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, ids, batch, config, return_entropy, chunk_size, wanted, fp32_weight_grad, backend
    ):
        B, T, H = hidden.shape
        N = B * T
        temperature = float(config.temperature)
        _, bwd = _kernels(backend)
        # Only active (mask != 0) tokens are swept: padding costs no matmul and no vocabulary
        # pass. idx [Na] are their flat positions; the sweep works on [Na] rows throughout,
        # in chunks split evenly over them.
        idx = batch.mask.reshape(-1).nonzero().squeeze(1)
        compact = idx.numel() < N
        rows = _chunk_rows(idx.numel(), weight.shape[0], hidden.element_size(), hidden.device, chunk_size)
        h = hidden.reshape(N, H)[idx] if compact else hidden.reshape(N, H)  # [Na, H]
        tok = ids.reshape(-1)[idx] if compact else ids.reshape(-1)  # [Na]
        tokens = batch.take(idx)  # the per-token inputs of those rows, flat [Na]
        grads = _grad_buffers(h, weight, bias, wanted, fp32_weight_grad)
        # With token-level ratios a token's dL/dlogp depends on its own logp only: known per chunk.
        one_sweep = any(wanted) and config.importance_sampling == "token"

        def backward_now(z, r, logp_rows, lse_rows):
            g = logp_grad(logp_rows, tokens.rows(r), config)
            _chunk_backward(z, tok[r], lse_rows, g, temperature, h[r], weight, bwd, grads, r)

        logp_a, lse, entropy_a = _logprobs_sweep(
            h,
            weight,
            bias,
            tok,
            temperature,
            rows,
            backend,
            return_entropy,
            on_chunk=backward_now if one_sweep else None,
        )
        logp = _scatter(logp_a, idx, N, compact).view(B, T)  # 0 on padding
        if any(wanted) and not one_sweep:  # sequence-level ratios: g needs every logp first
            g = logp_grad(logp, batch, config).view(-1)[idx]
            for r in _chunks(idx.numel(), rows):
                z = _chunk_logits(h[r], weight, bias)
                _chunk_backward(z, tok[r], lse[r], g[r], temperature, h[r], weight, bwd, grads, r)

        grad_hidden, grad_weight, grad_bias = grads
        if grad_hidden is not None and compact:
            grad_hidden = torch.zeros_like(hidden.reshape(N, H)).index_copy_(0, idx, grad_hidden)
        ctx.grads = grad_hidden, grad_weight, grad_bias
        ctx.hidden_shape = hidden.shape
        loss = policy_loss(logp, batch, config).loss
        ctx.mark_non_differentiable(logp)
        if entropy_a is None:
            return loss, logp
        entropy = _scatter(entropy_a, idx, N, compact).view(B, T)
        ctx.mark_non_differentiable(entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, *unused_grads):
        if ctx.grads is None:
            raise RuntimeError(
                "fused_linear_grpo_loss computes its gradients once, in the forward: a second backward through "
                "the same loss (retain_graph=True) is not supported; compute the loss again instead"
            )
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # the buffers are this call's own: scale them in place, then let go
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss).view(ctx.hidden_shape)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_loss)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _check_linear(hidden, weight, bias, ids, temperature, chunk_size) -> None:
    check_tensor("hidden", hidden, 3)
    check_tensor("weight", weight, 2)
    B, T, H = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight must have shape [V, H] with H = hidden.shape[-1] = {H}, got {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, 1)
        if bias.shape[0] != V:
            raise ValueError(f"bias must have shape [V] = [{V}] (weight.shape[0]), got {list(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have the dtype of hidden ({hidden.dtype}), got {bias.dtype}")
    for name, x in (("weight", weight), ("bias", bias), ("ids", ids)):
        if isinstance(x, torch.Tensor) and x.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {x.device}")
    check_ids(ids, (B, T), V)
    check_temperature(temperature)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (token rows per chunk) or None, got {chunk_size!r}")


def _check_call(hidden, weight, bias, ids, inputs: LossInputs, config: LossConfig, chunk_size) -> None:
    _check_linear(hidden, weight, bias, ids, config.temperature, chunk_size)
    inputs.check(hidden.shape[0], hidden.shape[1], config)


def fused_linear_loss_parts(
    hidden,
    weight,
    bias,
    ids,
    inputs: LossInputs,
    config: LossConfig,
    *,
    return_entropy,
    chunk_size=None,
    fp32_weight_grad=True,
):
    """The fused loss with the per-token values :func:`fused_linear_grpo_loss` reduces to
    metrics: ``(loss, logp [B, T], entropy [B, T] or None, batch)``, logp and entropy detached
    and 0 on padding, ``batch`` the prepared :class:`PolicyBatch`. Checks its inputs as the
    public op does; runs the fused kernels whatever the backend (the reference is the public
    op's). For callers that keep the per-token values (the trainer's first pass records its
    log-probs; TRL's metrics are per sequence) without a second sweep of the vocabulary."""
    _check_call(hidden, weight, bias, ids, inputs, config, chunk_size)
    B, T, _ = hidden.shape
    batch = PolicyBatch.prepare(config, (B, T), accumulate_dtype(hidden), hidden.device, inputs)
    wanted = tuple(torch.is_grad_enabled() and x is not None and x.requires_grad for x in (hidden, weight, bias))
    loss, logp, *entropy = FusedLinearGRPOFunction.apply(
        hidden,
        weight,
        bias,
        ids,
        batch,
        config,
        return_entropy,
        chunk_size,
        wanted,
        fp32_weight_grad,
        select_backend(hidden),
    )
    return loss, logp, (entropy[0] if return_entropy else None), batch


def loss_output(loss, logp, entropy, batch: PolicyBatch, config: LossConfig) -> LossOutput:
    """:func:`fused_linear_grpo_loss`'s result from :func:`fused_linear_loss_parts`' values:
    ``loss`` with the metrics of the per-token values."""
    with torch.no_grad():
        metrics = policy_loss(logp, batch, config, entropy)
    return metrics._replace(loss=loss)


def fused_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
):
    """Per-token log-probs of ``ids`` under the LM head, ``log_softmax((hidden @ weight.T + bias) / temperature)``
    gathered at ``ids``, without holding the [B, T, V] logits. No gradient: for the old-policy
    and reference log-probs of a GRPO step.

    Args:
        hidden: [B, T, H] last hidden states, fp16/bf16/fp32/fp64; position t predicts ``ids[:, t]``.
        weight: [V, H] LM-head weight, the dtype of ``hidden``.
        ids: [B, T] integer token ids in [0, V).
        bias: [V] or None.
        temperature: > 0; the logits are divided by it before the softmax.
        return_entropy: also return the per-token entropy [B, T].
        chunk_size: token rows per chunk (default: a fixed byte budget for the chunk's logits).

    Returns:
        logp [B, T] float32 (float64 for float64 inputs), detached; with ``return_entropy``,
        ``(logp, entropy)``.

    Example:
        >>> hidden = ref_model.model(input_ids).last_hidden_state[:, prompt_len - 1 : -1]
        >>> ref_logp = fused_linear_token_logprobs(hidden, ref_model.lm_head.weight, completion_ids)
    """
    _check_linear(hidden, weight, bias, ids, temperature, chunk_size)
    B, T, H = hidden.shape
    V = weight.shape[0]
    backend = select_backend(hidden)
    with torch.no_grad():
        if backend == "reference":
            logits = _chunk_logits(hidden.reshape(B * T, H), weight, bias).view(B, T, V)
            return reference.token_logprobs(logits, ids, temperature=temperature, return_entropy=return_entropy)
        rows = _chunk_rows(B * T, V, hidden.element_size(), hidden.device, chunk_size)
        logp, _, entropy = _logprobs_sweep(
            hidden.reshape(B * T, H), weight, bias, ids.reshape(-1), float(temperature), rows, backend, return_entropy
        )
    logp = logp.view(B, T)
    return (logp, entropy.view(B, T)) if return_entropy else logp


@loss_options
def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = True,
    num_items_in_batch=None,
    importance_weights: torch.Tensor | None = None,
    return_entropy: bool = False,
    loss_config: LossConfig | None = None,
) -> LossOutput:
    """The GRPO loss of :func:`grpo_fast.grpo_loss` on the logits ``hidden @ weight.T + bias``,
    computed chunk by chunk so that the [B, T, V] logits never exist.

    Peak extra memory is one chunk of logits plus the gradients themselves (the weight
    gradient in float32 for 16-bit weights), whatever B * T * V is. The gradients of hidden,
    weight and bias are computed during the forward, for the inputs that require them (a
    frozen weight gets none); ``loss.backward()`` then only scales them, so it may run once
    per call. Tied input/output embeddings work: autograd adds the two weight gradients.
    ``advantages``, ``mask``, ``old_logprobs``, ``ref_logprobs`` and ``importance_weights``
    are constants (no gradient flows to them).

    Args:
        hidden: [B, T, H] last hidden states, fp16/bf16/fp32/fp64 (any strides; copied to
            [B*T, H] when not viewable); position t predicts ``ids[:, t]``.
        weight: [V, H] LM-head weight, the dtype of ``hidden`` (tied embeddings welcome).
        ids: [B, T] integer completion tokens in [0, V).
        advantages, mask, old_logprobs, ref_logprobs: as in :func:`grpo_fast.grpo_loss`.
        bias: [V] LM-head bias, or None.
        chunk_size: token rows per chunk; default: a fixed byte budget for one chunk's
            logits (256 MiB on CPU, 1 GiB on CUDA), split evenly over the active tokens.
        fp32_weight_grad: accumulate the weight gradient over chunks in float32 when the
            weight is fp16/bf16 (one [V, H] float32 buffer); False accumulates in its dtype.
        num_items_in_batch, importance_weights, return_entropy, loss_config: as in
            :func:`grpo_fast.grpo_loss`.
        {loss_options}

    Returns:
        :class:`LossOutput`, as :func:`grpo_fast.grpo_loss`.

    Example:
        >>> hidden = model.model(input_ids).last_hidden_state[:, prompt_len - 1 : -1]  # [B, T, H]
        >>> out = fused_linear_grpo_loss(hidden, model.lm_head.weight, completion_ids, advantages,
        ...                              completion_mask, old_logp, ref_logp, beta=0.04)
        >>> out.loss.backward()
    """
    config = loss_config
    inputs = LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch)
    if select_backend(hidden) != "reference":
        parts = fused_linear_loss_parts(
            hidden,
            weight,
            bias,
            ids,
            inputs,
            config,
            return_entropy=return_entropy,
            chunk_size=chunk_size,
            fp32_weight_grad=fp32_weight_grad,
        )
        return loss_output(*parts, config)
    _check_call(hidden, weight, bias, ids, inputs, config, chunk_size)
    B, T, H = hidden.shape
    logits = _chunk_logits(hidden.reshape(B * T, H), weight, bias).view(B, T, weight.shape[0])
    return inputs.run_reference(reference.grpo_loss, logits, ids, config=config, return_entropy=return_entropy)
