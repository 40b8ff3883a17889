"""fused_linear_grpo_loss: the GRPO loss from the last hidden states and the LM head, without
ever holding the [B, T, V] logits.

Order: the chunk steps (shared with ``fused_linear_token_logprobs``), the autograd.Function,
the public functions. The vocabulary-sized work of a chunk is the token_logprobs kernels
(Triton on CUDA, the chunked torch path on CPU); the per-token policy math is
``ops/policy.py``, as in grpo_loss, and runs once per token.

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
couples the tokens of a row: there the forward sweeps once for logp, forms g for every
token, and sweeps again, recomputing the logits, for the gradients (four matmuls).

The tokens are flat rows h [N, H] throughout: a packed forward's [Nc, H] as they come (with
their sequence boundaries ``cu_seqlens``), or a [B, T] grid's active tokens.
"""

from typing import NamedTuple

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.ops._validate import check_cu_seqlens, check_ids, check_temperature, check_tensor, loss_options
from grpo_fast.ops.policy import Evaluation, LossInputs, PolicyBatch
from grpo_fast.ops.token_logprobs import _kernels
from grpo_fast.outputs import LossOutput
from grpo_fast.spec import LossConfig, accumulate_dtype

# Bytes of one chunk's logits [n, V] by default. Every chunk re-reads and re-writes the
# [V, H] weight gradient, so chunks must be tall for the matmuls to run near peak; a GPU
# needs taller ones than a CPU. Either way it is a small, fixed fraction of [B*T, V].
# (Not token_logprobs' CHUNK_BYTES, a per-thread budget of its float32 scratch.)
LOGITS_CHUNK_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}


def _chunk_rows(N: int, V: int, itemsize: int, device: torch.device, chunk_size: int | None) -> int:
    """Token rows per chunk: ``chunk_size`` if given, else the byte budget split evenly over N."""
    if chunk_size is not None:
        return chunk_size
    rows = max(1, LOGITS_CHUNK_BYTES.get(device.type, LOGITS_CHUNK_BYTES["cpu"]) // (V * itemsize))
    n_chunks = max(1, -(-N // rows))
    return max(1, -(-N // n_chunks))  # equal chunks: no thin remainder that would run a slow matmul


def fused_head_saves_memory(num_tokens: int, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the fused head can hold less than a plain LM head followed by ``token_logprobs``
    for ``num_tokens`` rows of logits in ``dtype``, with LM-head weight [V, H]. Not when those
    logits fit one default chunk: the fused head then holds that chunk as well and, from its
    forward on, the float32 [V, H] weight gradient, which the plain head makes only in the
    backward (the 100m preset of ``grpo-fast bench memory``: 15 MiB above eager). Where that
    gradient is under 1 MiB (tiny models) the routes' peaks differ by less than a run's noise,
    and the fused head is kept."""
    V, H = weight.shape
    one_chunk = num_tokens <= _chunk_rows(num_tokens, V, dtype.itemsize, weight.device, None)
    return not one_chunk or V * H * 4 < 1 << 20


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


class TokenValues(NamedTuple):
    """The per-token values behind a fused loss, flat over the swept tokens [Na] (all of them
    for flat rows; the active ones of a grid): log-probs and entropy (None unless asked),
    detached; the policy math's :class:`~grpo_fast.ops.policy.Evaluation` and the prepared
    :class:`~grpo_fast.ops.policy.PolicyBatch` of those tokens; ``positions`` [Na] their flat
    places on the grid [B * T] (None: every place, in order)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    evaluation: Evaluation
    batch: PolicyBatch
    positions: torch.Tensor | None = None

    def on_grid(self, x: torch.Tensor, shape) -> torch.Tensor:
        """Per-token values [Na] on the grid ``shape`` [B, T], 0 where no token was swept."""
        if self.positions is None:
            return x.view(shape)
        return x.new_zeros(shape.numel()).index_copy_(0, self.positions, x).view(shape)


class FusedLinearGRPOFunction(torch.autograd.Function):
    """(hidden [Na, H], weight [V, H], bias [V] or None) -> loss, for flat token rows.

    ``batch`` and ``config`` are the loss's prepared per-token inputs of the rows and its
    options (``ops/policy.py``). The forward computes the gradients of the inputs flagged in
    ``wanted`` for dL/dloss = 1 (see the module docstring) and puts the per-token values in
    ``out`` (a list, given empty: :class:`TokenValues`); the backward scales the gradients
    by the incoming dL/dloss.
    """

    @staticmethod
    def forward(
        ctx,
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
        backend,
        out,
    ):
        N = hidden.shape[0]
        temperature = float(config.temperature)
        _, bwd = _kernels(backend)
        rows = _chunk_rows(N, weight.shape[0], hidden.element_size(), hidden.device, chunk_size)
        grads = _grad_buffers(hidden, weight, bias, wanted, fp32_weight_grad)
        want_grad = any(wanted)
        token_level = config.importance_sampling == "token"
        # With token-level ratios a token's loss term and dL/dlogp depend on its own logp only:
        # the policy math runs per chunk, once per token, and the gradients follow at once.
        w = torch.empty(N, dtype=accumulate_dtype(hidden), device=hidden.device)
        kl = None if batch.ref is None else torch.empty_like(w)
        partial_sums = []

        def evaluate_chunk(z, r, logp_rows, lse_rows):
            ev = batch.take(r).evaluate(logp_rows, config, grad=want_grad)
            partial_sums.append(ev.terms.sum())
            w[r] = ev.w
            if kl is not None:
                kl[r] = ev.kl
            if want_grad:
                _chunk_backward(z, ids[r], lse_rows, ev.grad, temperature, hidden[r], weight, bwd, grads, r)

        logp, lse, entropy = _logprobs_sweep(
            hidden,
            weight,
            bias,
            ids,
            temperature,
            rows,
            backend,
            return_entropy,
            evaluate_chunk if token_level else None,
        )
        if token_level:
            loss = torch.stack(partial_sums).sum() if partial_sums else logp.new_zeros(())
            ev = Evaluation(None, None, w, None, kl)
        else:  # sequence-level ratios: dL/dlogp needs every logp first; a second sweep for the gradients
            ev = batch.evaluate(logp, config, grad=want_grad)
            loss = ev.terms.sum()
            if want_grad:
                for r in _chunks(N, rows):
                    z = _chunk_logits(hidden[r], weight, bias)
                    _chunk_backward(z, ids[r], lse[r], ev.grad[r], temperature, hidden[r], weight, bwd, grads, r)
            ev = ev._replace(terms=None, grad=None)
        out.append(TokenValues(logp, entropy, ev, batch))
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError(
                "fused_linear_grpo_loss computes its gradients once, in the forward: a second backward through "
                "the same loss (retain_graph=True) is not supported; compute the loss again instead"
            )
        grads = tuple(None if g is None else g.mul_(grad_loss) for g in ctx.grads)
        ctx.grads = None  # the buffers are this call's own: scaled in place, then let go
        return *grads, None, None, None, None, None, None, None, None, None


def check_linear(hidden, weight, bias, ids, temperature, chunk_size, *, flat: bool = False) -> None:
    """The LM-head operands: hidden [B, T, H] and ids [B, T], or with ``flat`` [Nc, H] and [Nc]."""
    check_tensor("hidden", hidden, 2 if flat else 3)
    check_tensor("weight", weight, 2)
    H = hidden.shape[-1]
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
    check_ids(ids, hidden.shape[:-1], V)
    check_temperature(temperature)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (token rows per chunk) or None, got {chunk_size!r}")


def _check_call(hidden, weight, bias, ids, inputs: LossInputs, config: LossConfig, chunk_size) -> None:
    flat = inputs.cu_seqlens is not None
    check_linear(hidden, weight, bias, ids, config.temperature, chunk_size, flat=flat)
    if flat:
        check_cu_seqlens(inputs.cu_seqlens, hidden.shape[0], hidden.device)
    inputs.check(hidden.shape[:-1], config)


def fused_linear_loss_with_tokens(
    hidden,
    weight,
    bias,
    ids,
    inputs: LossInputs,
    config: LossConfig,
    *,
    return_entropy=False,
    chunk_size=None,
    fp32_weight_grad=True,
) -> tuple:
    """:func:`fused_linear_grpo_loss` (checks included; the fused kernels whatever the
    backend) with the per-token values behind it: ``(LossOutput, TokenValues)``, for callers
    that keep them (the trainer records its first pass's log-probs; TRL's metrics are per
    sequence) without a second sweep of the vocabulary or of the policy math.

    Flat rows (``inputs.cu_seqlens`` given: hidden [Nc, H], ids and per-token inputs [Nc])
    are swept as they are. A grid (hidden [B, T, H]) sweeps its active (mask != 0) tokens
    only, so padding costs no matmul: their positions are found with ``nonzero`` (a host
    sync on CUDA), and the values of :class:`TokenValues` are those tokens' [Na].
    """
    _check_call(hidden, weight, bias, ids, inputs, config, chunk_size)
    batch = PolicyBatch.prepare(config, hidden.shape[:-1], accumulate_dtype(hidden), hidden.device, inputs)
    h, tok, active = hidden, ids, None
    if inputs.cu_seqlens is None:
        N = ids.numel()
        h, tok = hidden.reshape(N, hidden.shape[-1]), ids.reshape(N)
        if inputs.mask is not None:
            active = batch.mask.nonzero().squeeze(1)
            h, tok, batch = h[active], tok[active], batch.take(active)  # indexing h scatters its gradient back
    wanted = tuple(torch.is_grad_enabled() and x is not None and x.requires_grad for x in (hidden, weight, bias))
    values = []
    loss = FusedLinearGRPOFunction.apply(
        h,
        weight,
        bias,
        tok,
        batch,
        config,
        return_entropy,
        chunk_size,
        wanted,
        fp32_weight_grad,
        select_backend(hidden),
        values,
    )
    tokens = values[0]._replace(positions=active)
    out = LossOutput(loss, **batch.metrics(tokens.evaluation, config, tokens.entropy))
    return out, tokens


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
    cu_seqlens: torch.Tensor | None = None,
    loss_config: LossConfig | None = None,
) -> LossOutput:
    """The GRPO loss of :func:`grpo_fast.grpo_loss` on the logits ``hidden @ weight.T + bias``,
    computed chunk by chunk so that the [B, T, V] logits never exist; from a [B, T] grid, or
    from the flat token rows [Nc] of packed sequences.

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
            logits (``LOGITS_CHUNK_BYTES``: 256 MiB on CPU, 1 GiB on CUDA), split evenly over
            the swept tokens.
        fp32_weight_grad: accumulate the weight gradient over chunks in float32 when the
            weight is fp16/bf16 (one [V, H] float32 buffer); False accumulates in its dtype.
        num_items_in_batch, importance_weights, return_entropy, loss_config: as in
            :func:`grpo_fast.grpo_loss`.
        cu_seqlens: [n + 1] integer sequence boundaries when the tokens are flat rows (as
            :func:`grpo_fast.policy_loss`): hidden [Nc, H], ids, mask, old and reference
            log-probs [Nc], advantages and importance weights [Nc] or [n, 1] per sequence. No
            padding is swept; a padded grid's inactive tokens are skipped too, found on the host.
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
    inputs = LossInputs(
        advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch, cu_seqlens
    )
    if select_backend(hidden) != "reference" or cu_seqlens is not None:
        out, _ = fused_linear_loss_with_tokens(
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
        return out
    _check_call(hidden, weight, bias, ids, inputs, config, chunk_size)
    B, T, H = hidden.shape
    logits = _chunk_logits(hidden.reshape(B * T, H), weight, bias).view(B, T, weight.shape[0])
    return inputs.run_reference(reference.grpo_loss, logits, ids, config=config, return_entropy=return_entropy)
