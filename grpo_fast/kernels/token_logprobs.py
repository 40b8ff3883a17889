"""Triton token log-probs: online log-sum-exp over the vocabulary, gather, entropy, backward.

Order: the two row helpers (shared with ``grpo_loss``), the forward and backward kernels,
their launchers ``logprobs_fwd`` / ``logprobs_bwd`` (the contract of
``grpo_fast.ops.token_logprobs.logprobs_fwd_torch`` / ``logprobs_bwd_torch``).

One program per token row. With x = logits / tau and p = softmax(x):

    lse  = log sum_v exp(x_v)                   (online: running max m, rescaled sum)
    logp = x[id] - lse
    H    = -sum_v p_v log p_v = lse - sum_v p_v x_v
    dL/dlogits_v = g * (onehot(id)_v - p_v) / tau,    g = dL/dlogp

Everything accumulates in float32 whatever the logits' dtype (float64 logits: in float64,
the dtype of the log-prob outputs); logits may have any strides.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.spec import accumulate_dtype

# Largest vocabulary block per loop step (contiguous rows, and rows read along a non-unit
# stride); tests lower them so that tiny vocabularies span blocks.
MAX_BLOCK_V = 4096
MAX_STRIDED_BLOCK_V = 1024


@triton.jit
def _row_logsumexp(
    row_ptr,  # first logit of the row
    stride_v,  # element stride along the vocabulary
    V,
    inv_tau,  # 1 / temperature
    ACC: tl.constexpr,  # accumulation dtype: float32, or float64 for float64 logits
    BLOCK_V: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
):
    """Returns (lse, sum_v p_v x_v) of x = row * inv_tau; the second is 0 without RETURN_ENTROPY."""
    m = tl.full([], float("-inf"), ACC)
    # Scalar running sums, rescaled by the running max: each block is reduced at once (its
    # max, then its sums) instead of carrying per-lane partial sums
    # across the loop. Two [BLOCK_V] carried vectors cost 16 registers each per thread at
    # BLOCK_V 4096 / 8 warps: the loss kernel with entropy fell from 128 to 64 registers,
    # i.e. from 2 to 4 resident CTAs and 16 to 33 KB of loads in flight per SM
    # (benchmarks/NOTES.md, "Register pressure").
    s = tl.full([], 0.0, ACC)
    sx = tl.full([], 0.0, ACC)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
        x = x.to(ACC) * inv_tau
        m_new = tl.maximum(m, tl.max(x, 0))
        # While every logit so far is -inf (padded vocabulary) shift by 0, not by -inf - -inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        e = tl.exp(x - shift)
        s = s * alpha + tl.sum(e, 0)
        if RETURN_ENTROPY:
            sx = sx * alpha + tl.sum(e * tl.where(e > 0, x, 0.0), 0)  # p = 0 at x = -inf: 0, not 0 * -inf
        m = m_new
    total = s
    return m + tl.log(total), sx / total


@triton.jit
def _row_grad(
    row_ptr,  # first logit of the row
    stride_v,
    out_ptr,  # first gradient element of the row (may alias row_ptr: in-place backward)
    stride_out_v,
    V,
    inv_tau,
    lse,  # log-sum-exp of the row / tau, in the accumulation dtype
    coef,  # dL/dlogp / tau
    tok,  # the row's token id
    BLOCK_V: tl.constexpr,
):
    """Writes coef * (onehot(tok) - softmax(row / tau)) along the row, in the output's dtype."""
    n_blocks = tl.cdiv(V, BLOCK_V)
    if coef == 0.0:
        # Masked or zero-weight token: the gradient is zero, no need to read the logits.
        for i in range(0, n_blocks):
            cols = i * BLOCK_V + tl.arange(0, BLOCK_V)
            zero = tl.zeros([BLOCK_V], tl.float32).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + cols.to(tl.int64) * stride_out_v, zero, mask=cols < V)
    else:
        # Last block first: right after a log-sum-exp sweep those are the ones still in L2.
        for i in range(0, n_blocks):
            cols = (n_blocks - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
            p = tl.exp(x.to(lse.dtype) * inv_tau - lse)
            g = coef * (tl.where(cols == tok, 1.0, 0.0) - p)
            tl.store(out_ptr + cols.to(tl.int64) * stride_out_v, g.to(out_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr,  # [B, T, V], any strides
    stride_b,
    stride_t,
    stride_v,
    ids_ptr,  # [B * T] contiguous
    logp_ptr,  # [B * T] out, float32 (float64 for float64 logits): sets the accumulation dtype
    lse_ptr,  # [B * T] out, as logp
    entropy_ptr,  # [B * T] out, as logp; unused without RETURN_ENTROPY
    T,
    V,
    inv_tau,
    BLOCK_V: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    row_ptr = logits_ptr + b * stride_b + t * stride_t
    acc = logp_ptr.dtype.element_ty
    lse, mean_x = _row_logsumexp(row_ptr, stride_v, V, inv_tau, acc, BLOCK_V, RETURN_ENTROPY)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    x_tok = tl.load(row_ptr + tok * stride_v).to(acc) * inv_tau
    tl.store(logp_ptr + row, x_tok - lse)
    tl.store(lse_ptr + row, lse)
    if RETURN_ENTROPY:
        tl.store(entropy_ptr + row, lse - mean_x)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr,  # [B, T, V], any strides
    stride_b,
    stride_t,
    stride_v,
    out_ptr,  # [B, T, V] dL/dlogits, any strides (may be logits_ptr)
    stride_out_b,
    stride_out_t,
    stride_out_v,
    ids_ptr,  # [B * T] contiguous
    lse_ptr,  # [B * T] from the forward, in the accumulation dtype
    grad_logp_ptr,  # [B * T] dL/dlogp, as lse
    T,
    V,
    inv_tau,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    coef = tl.load(grad_logp_ptr + row) * inv_tau
    _row_grad(
        logits_ptr + b * stride_b + t * stride_t,
        stride_v,
        out_ptr + b * stride_out_b + t * stride_out_t,
        stride_out_v,
        V,
        inv_tau,
        tl.load(lse_ptr + row),
        coef,
        tl.load(ids_ptr + row),
        BLOCK_V,
    )


def device_guard(x: torch.Tensor):
    """The launch context of a kernel reading ``x``: ``torch.cuda.device(x.device)``, since
    Triton launches on the current device, which need not be x's (flash-attention does the
    same). Index -1 (a CPU tensor, under the interpreter) switches nothing."""
    return torch.cuda.device(x.device if x.is_cuda else -1)


def block_size(V: int, block_v: int | None = None, stride_v: int = 1) -> int:
    """The vocabulary block: ``block_v`` if given (a power of two), else up to MAX_BLOCK_V, or
    up to MAX_STRIDED_BLOCK_V along a non-unit stride (every element its own load and 64-bit
    address: 16 per thread took 110 registers, 8 per thread 48)."""
    if block_v is not None:
        if block_v < 1 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of two, got {block_v}")
        return block_v
    return min(MAX_BLOCK_V if stride_v == 1 else MAX_STRIDED_BLOCK_V, triton.next_power_of_2(V))


def num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def logprobs_fwd(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    block_v: int | None = None,
):
    """logits [B, T, V] (any strides), ids [B, T] -> logp, lse (of logits / temperature),
    entropy or None; each [B, T] float32 (float64 for float64 logits). Reads the logits once."""
    B, T, V = logits.shape
    logp = torch.empty(B, T, dtype=accumulate_dtype(logits), device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if return_entropy else None
    if B * T == 0:
        return logp, lse, entropy
    block = block_size(V, block_v, logits.stride(2))
    with device_guard(logits):
        _logprobs_fwd_kernel[(B * T,)](
            logits,
            *logits.stride(),
            ids.reshape(-1).contiguous(),
            logp,
            lse,
            logp if entropy is None else entropy,
            T,
            V,
            1.0 / temperature,
            BLOCK_V=block,
            RETURN_ENTROPY=return_entropy,
            num_warps=num_warps(block),
        )
    return logp, lse, entropy


def logprobs_bwd(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    out: torch.Tensor,
    block_v: int | None = None,
) -> torch.Tensor:
    """Writes dL/dlogits [B, T, V] into ``out`` (any strides; may be ``logits`` itself) from
    grad_logp [B, T] and the forward's lse [B, T]; rows with zero grad_logp are not read."""
    B, T, V = logits.shape
    if B * T == 0:
        return out
    block = block_size(V, block_v, max(logits.stride(2), out.stride(2)))
    with device_guard(logits):
        _logprobs_bwd_kernel[(B * T,)](
            logits,
            *logits.stride(),
            out,
            *out.stride(),
            ids.reshape(-1).contiguous(),
            lse.reshape(-1).contiguous(),
            grad_logp.reshape(-1).to(lse.dtype).contiguous(),
            T,
            V,
            1.0 / temperature,
            BLOCK_V=block,
            num_warps=num_warps(block),
        )
    return out
