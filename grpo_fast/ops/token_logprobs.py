"""token_logprobs: log_softmax(logits / temperature) gathered at ids, without [B, T, V] temporaries.

Order: the CPU row math that inductor compiles, the torch path (forward, backward: compiled
over all rows at once, or eager chunks), the autograd.Function, the public function. The
Triton path (CUDA) lives in ``grpo_fast/kernels/token_logprobs.py`` with the same two entry
points, ``logprobs_fwd`` and ``logprobs_bwd``.

Backward, for g = dL/dlogp [B, T] and p = softmax(logits / tau):

    dL/dlogits[b, t, v] = g[b, t] * (onehot(ids[b, t])[v] - p[b, t, v]) / tau

so the forward saves only the per-token log-sum-exp [B, T] and recomputes p chunk by chunk.
"""

import functools
import warnings

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import cpu_compile, select_backend
from grpo_fast.ops._validate import check_ids, check_temperature, check_tensor
from grpo_fast.spec import accumulate_dtype

# Rows per chunk are sized so that one chunk's float32 copy is about this many bytes per
# intra-op thread. Every op on a chunk is one parallel region, which ends in a barrier: on a
# 2-core machine whose cores are shared with other work, a barrier waits for a descheduled
# thread, so more threads want fewer, larger chunks; on one thread a chunk should stay
# small enough to be reused from cache. Measured side by side (benchmarks/NOTES.md, "CPU
# path under load"): at 1 thread 16 MiB chunks beat 32 and 64 MiB (2.5x plain eager against
# 1.7x and 1.3x, bf16); at 2 threads on a loaded machine 32-64 MiB beat 16 MiB (1.0-1.1x
# plain against 0.8x).
CHUNK_BYTES = 16 << 20
MAX_CHUNK_BYTES = 256 << 20


def _row_chunks(tensors, rows: int):
    """Yields ``(chunks, flat row slice)``: the same ``[n, V]`` rows of each tensor [B, T, V].

    Tensors that all flatten without a copy are walked as flat rows; otherwise (a slice such
    as ``logits[:, :-1]``) sequence by sequence, so no chunk ever needs ``.contiguous()``.
    """
    B, T, V = tensors[0].shape
    try:
        flats = [t.view(B * T, V) for t in tensors]
    except RuntimeError:
        flats = None
    if flats is not None:
        for r0 in range(0, B * T, rows):
            yield [f[r0 : r0 + rows] for f in flats], slice(r0, min(r0 + rows, B * T))
        return
    for b in range(B):
        for t0 in range(0, T, rows):
            yield [t[b, t0 : t0 + rows] for t in tensors], slice(b * T + t0, b * T + min(t0 + rows, T))


def _rows_per_chunk(V: int) -> int:
    return max(1, min(CHUNK_BYTES * torch.get_num_threads(), MAX_CHUNK_BYTES) // (4 * V))


def _scratch(logits: torch.Tensor, acc: torch.dtype, count: int) -> list:
    """``count`` [rows, V] ``acc`` buffers that every chunk of one call reuses: a fresh buffer
    per chunk would be page-faulted in anew each time (allocations this large are mmapped)."""
    B, T, V = logits.shape
    rows = min(_rows_per_chunk(V), B * T)
    return [torch.empty(rows, V, dtype=acc, device=logits.device) for _ in range(count)]


def _upcast(chunk: torch.Tensor, temperature: float, buffer: torch.Tensor, shift=None) -> torch.Tensor:
    """chunk / temperature, less ``shift`` [n, 1] if given, as rows of ``buffer``'s dtype
    (float32): the chunk itself where that changes nothing (it is never written), else the
    first rows of ``buffer``, in as few passes as the ops allow (one for a float32 chunk at
    temperature 1: each pass over a chunk is about as slow as the ops on it). A 16-bit chunk
    is upcast by a plain copy: elementwise ops that mix 16-bit and float32 operands take a slow
    per-element path on CPU (10-20x a same-dtype op, measured), so every later op runs on one
    dtype."""
    x = buffer[: chunk.shape[0]]
    if chunk.dtype != x.dtype:
        chunk = x.copy_(chunk)
    elif temperature == 1.0 and shift is None:
        return chunk
    if temperature != 1.0:
        chunk = torch.mul(chunk, 1.0 / temperature, out=x)
    return chunk if shift is None else torch.sub(chunk, shift, out=x)


def _rows_fwd(x: torch.Tensor, ids: torch.Tensor, inv_t: torch.Tensor, return_entropy: bool):
    """x [n, V] (rows contiguous), ids [n, 1], inv_t 0-dim (1 / temperature) -> logp, lse of
    x * inv_t and the entropy (None without ``return_entropy``), each [n, 1] in the
    accumulation dtype.

    Written for inductor: it makes one loop over rows whose max, sum of exp and sum of
    p * z are reductions over the row while it is in cache, and stores nothing [n, V]. The
    eager ops would be a parallel region each over the whole block (benchmarks/NOTES.md)."""
    z = x.to(accumulate_dtype(x)) * inv_t
    m = z.amax(-1, keepdim=True)
    e = (z - m).exp()
    s = e.sum(-1, keepdim=True)
    lse = s.log() + m
    entropy = lse - (e * z).sum(-1, keepdim=True) / s if return_entropy else None
    return z.gather(-1, ids) - lse, lse, entropy


def _rows_bwd(x, ids, lse, coef, inv_t, out):
    """Writes coef * (onehot(ids) - exp(x * inv_t - lse)) into ``out`` [n, V] (into x itself
    when None), in its dtype: one pass, no float32 [n, V] copy. ids, lse, coef [n, 1]."""
    z = x.to(accumulate_dtype(x)) * inv_t
    hit = torch.arange(x.shape[-1], device=x.device) == ids
    (x if out is None else out).copy_(coef * (hit.to(z.dtype) - (z - lse).exp()))


@functools.cache
def _compiled(fn):
    """``fn`` compiled once per process for any number of rows (recompiled per dtype)."""
    return torch.compile(fn, dynamic=True)


def _run_compiled(fn, *args):
    """``fn`` compiled, on ``args`` as the caller detached them: each variant (dtype, entropy,
    in place) is its own compile, and a hit of dynamo's default limit of 8 would silently run
    ``fn`` eagerly over every row at once, float32 copies and all; so the limit is raised for
    this call and a hit of it raises instead."""
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        return _compiled(fn)(*args)


@functools.cache
def _inductor_builds() -> bool:
    """Whether inductor builds CPU kernels here (it needs a C++ compiler), tried once on a tiny
    block; when it cannot, a warning says why and the eager chunks run instead."""
    x, ids, one = torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.tensor(1.0)
    try:
        _, lse, _ = _run_compiled(_rows_fwd, x, ids, one, False)
        _run_compiled(_rows_bwd, x, ids, lse, torch.ones_like(lse), one, torch.empty_like(x))
    except Exception as exc:  # noqa: BLE001 - any failure to build means: use the eager path
        warnings.warn(f"grpo_fast: torch.compile cannot build CPU kernels here ({exc!r}); using the eager path")
        return False
    return True


def _use_compiled(logits: torch.Tensor) -> bool:
    # Inside a caller's own torch.compile the eager chunks are what its compile should trace.
    return cpu_compile(logits) and not torch.compiler.is_compiling() and _inductor_builds()


def logprobs_fwd_torch(logits: torch.Tensor, ids: torch.Tensor, temperature: float, return_entropy: bool):
    """The CPU forward. logits [B, T, V] (any strides), ids [B, T] ->
    logp [B, T], lse [B, T] (of logits / temperature), entropy [B, T] or None; float32.

    Compiled (``_rows_fwd``), all rows in one call, or sequence by sequence for logits that do
    not flatten. Eager, chunk by chunk: the upcast (none for float32 at temperature 1) and a
    log_softmax pass over [n, V] (three more with entropy), each one parallel region: on a
    machine whose cores are shared every region ends in a barrier that waits for the slowest
    thread, so the number of regions sets the time there
    (benchmarks/NOTES.md).
    """
    B, T, V = logits.shape
    acc = accumulate_dtype(logits)
    logp = torch.empty(B * T, 1, dtype=acc, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if return_entropy else None
    flat_ids = ids.reshape(-1, 1).long()
    if _use_compiled(logits):
        rows, inv_t = B * T, torch.tensor(1.0 / temperature, dtype=acc)

        def block(chunk, tok):  # detached: no guards on requires_grad or on the view's base
            return _run_compiled(_rows_fwd, chunk.detach(), tok, inv_t, return_entropy)

    else:
        rows = _rows_per_chunk(V)
        x_buffer, logsm_buffer = _scratch(logits, acc, 2)

        def block(chunk, tok):
            x = _upcast(chunk, temperature, x_buffer)  # [n, V], x = logits / tau
            logsm = torch.log_softmax(x, dim=-1, out=logsm_buffer[: x.shape[0]])  # one fused pass
            picked = logsm.gather(1, tok)
            lse = x.gather(1, tok) - picked
            # H = lse - sum_v p_v x_v, p = exp(log_softmax(x))
            entropy = lse - logsm.exp_().mul_(x).sum(-1, keepdim=True) if return_entropy else None
            return picked, lse, entropy

    for (chunk,), r in _row_chunks([logits], rows):
        for out, value in zip((logp, lse, entropy), block(chunk, flat_ids[r])):
            if out is not None:
                out[r] = value
    shape = (B, T)
    return logp.view(shape), lse.view(shape), None if entropy is None else entropy.view(shape)


def logprobs_bwd_torch(
    logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor, temperature: float, out
):
    """The CPU backward: writes dL/dlogits into ``out`` [B, T, V] (may be ``logits`` itself).
    Compiled (``_rows_bwd``), one pass; eager, per chunk the upcast, p = exp(x / tau - lse) in
    place, and the scaled write in the output's dtype."""
    B, T, V = logits.shape
    acc = accumulate_dtype(logits)
    coef = (grad_logp.to(acc) / temperature).reshape(-1, 1)  # g / tau, [B*T, 1]
    flat_ids = ids.reshape(-1, 1).long()
    flat_lse = lse.reshape(-1, 1).to(acc)
    if _use_compiled(logits):
        inv_t = torch.tensor(1.0 / temperature, dtype=acc)
        for (chunk, out_chunk), r in _row_chunks([logits, out], B * T):
            target = None if out is logits else out_chunk.detach()  # detached: see logprobs_fwd_torch
            _run_compiled(_rows_bwd, chunk.detach(), flat_ids[r], flat_lse[r], coef[r], inv_t, target)
        return out
    (buffer,) = _scratch(logits, acc, 1)
    for (chunk, out_chunk), r in _row_chunks([logits, out], _rows_per_chunk(V)):
        p = _upcast(chunk, temperature, buffer, flat_lse[r]).exp_()  # softmax(x / tau), [n, V]
        p.scatter_add_(1, flat_ids[r], torch.full_like(coef[r], -1.0))  # p - onehot
        torch.mul(p, -coef[r], out=out_chunk)  # coef * (onehot - p), in the output's dtype
    return out


def _kernels(backend: str):
    if backend == "triton":
        from grpo_fast.kernels import token_logprobs as triton_path

        return triton_path.logprobs_fwd, triton_path.logprobs_bwd
    return logprobs_fwd_torch, logprobs_bwd_torch


class TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, return_entropy, inplace_backward, backend):
        fwd, _ = _kernels(backend)
        logp, lse, entropy = fwd(logits, ids, temperature, return_entropy)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.inplace_backward, ctx.backend = temperature, inplace_backward, backend
        if entropy is None:
            return logp
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, *unused_grad_entropy):
        logits, ids, lse = ctx.saved_tensors
        _, bwd = _kernels(ctx.backend)
        out = logits if ctx.inplace_backward else torch.empty_like(logits)
        grad = bwd(logits, ids, lse, grad_logp, ctx.temperature, out)
        return grad, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
):
    """Per-token log-probabilities of ``ids`` under ``logits / temperature``.

    Args:
        logits: [B, T, V] float16/bfloat16/float32/float64, any strides (a slice such as
            ``logits[:, :-1]`` is read in place, never copied).
        ids: [B, T] integer token ids in [0, V).
        temperature: > 0; the logits are divided by it before the softmax.
        return_entropy: also return the per-token entropy [B, T] (float32, no gradient).
        inplace_backward: write dL/dlogits into the logits buffer during backward, so that
            backward needs no second [B, T, V] buffer. The logits' values are destroyed:
            only set it when nothing else will read them.

    Returns:
        logp [B, T] float32 (float64 for float64 logits), differentiable with respect to
        ``logits``; with ``return_entropy``, ``(logp, entropy)``.

    Example:
        >>> logits = model(input_ids).logits                       # [B, L, V]
        >>> logp = token_logprobs(logits[:, :-1], input_ids[:, 1:])  # [B, L - 1]
    """
    check_tensor("logits", logits, 3)
    check_ids(ids, logits.shape[:2], logits.shape[2])
    check_temperature(temperature)
    if ids.device != logits.device:
        raise ValueError(f"ids must be on the logits' device {logits.device}, got {ids.device}")
    backend = select_backend(logits)
    if backend == "reference":
        return reference.token_logprobs(logits, ids, temperature=temperature, return_entropy=return_entropy)
    return TokenLogprobsFunction.apply(logits, ids, float(temperature), return_entropy, inplace_backward, backend)
