"""The token-level GRPO loss in one launch: log-probs, policy math and dL/dlogits together.

Order: the per-token policy terms, the forward kernel, the gradient-rescale kernel, their
launchers ``grpo_loss_fwd`` and ``scale_grad_``; the autograd.Function around them is in
``grpo_fast/ops/grpo_loss.py``, which takes this path for ``importance_sampling="token"``.

The loss is terminal, so once a row's log-sum-exp is known so is its coefficient
``c = dL/dlogp`` and the same program writes ``dL/dlogits = c * (onehot(id) - p) / tau``:
the logits are swept twice by one program (the second sweep, last block first, mostly hits
L2) and the gradient is written once. With L = sum_t weight_t * (iw_t * pg_t + beta * kl_t):

    c_t = weight_t * iw_t * dpg_t/dlogp + weight_t * beta * dkl_t/dlogp

where weight_t = dL/dper_token_t is the loss type's aggregation (grpo: m / (B * len_b), bnpo:
m / sum m, ...), the loss spec's token weights (``grpo_fast/spec.py``) prepared on [B, T] in
torch. The kernel writes, per token, the weighted loss term and the metrics' masked pieces
(KL, clip flags, ratio, entropy); one ``sum`` over them gives the
loss and every metric. Padding rows are not read: zero terms, zero gradient. Backward only
multiplies by the incoming gradient, and only when it is not 1, deciding on the device (no
host sync). Scalars (beta, eps, delta, temperature, ...) are runtime arguments: changing
them does not recompile.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.token_logprobs import _row_grad, _row_logsumexp, block_size, device_guard, num_warps


@triton.jit
def _policy_terms(
    logp, old, adv, ref, has_old, eps_low, eps_high, delta, dual_clip, tau_pos, tau_neg, loss_kind, kl_kind, kl_bias
):
    """One token's (pg, d pg / dlogp, kl, d kl / dlogp, ratio w, clipped low, clipped high),
    with torch's subgradients at ties.

    w = exp(logp - old) (1 on-policy, where old = logp.detach()), dw/dlogp = w.
    clipped: pg = -min(w1 A, w2 A), w1 = min(w, delta), w2 = clamp(w, 1 - eps_low, 1 + eps_high);
             torch.min splits the gradient in half on ties, clamp passes it on its closed range.
             dual clip (A < 0): pg <- min(pg, -A c), the cap is constant in logp.
    cispo:   pg = -min(w, eps_high).detach() * A * logp        -> -min(w, eps_high) * A
    sapo:    pg = -sigmoid(tau (w - 1)) * 4 / tau * A          -> -4 A s (1 - s) w
    kl, d = ref - logp:  k3 exp(d) - d - 1 -> 1 - exp(d);  k1 -d -> 1;  k2 d^2 / 2 -> -d
    bias-corrected kl:   w kl -> w kl + w dkl/dlogp
    """
    w = tl.exp(tl.where(has_old != 0, logp - old, 0.0))
    w1 = tl.minimum(w, delta)
    dw1 = tl.where(w <= delta, w, 0.0)
    w2 = tl.minimum(tl.maximum(w, 1.0 - eps_low), 1.0 + eps_high)
    dw2 = tl.where((w >= 1.0 - eps_low) & (w <= 1.0 + eps_high), w, 0.0)
    a = w1 * adv
    b = w2 * adv
    pg_clip = -tl.minimum(a, b)
    d_clip = -adv * tl.where(a < b, dw1, tl.where(b < a, dw2, 0.5 * (dw1 + dw2)))
    cap = -adv * dual_clip
    dual = adv < 0
    d_clip = tl.where(dual & (pg_clip > cap), 0.0, tl.where(dual & (pg_clip == cap), 0.5 * d_clip, d_clip))
    pg_clip = tl.where(dual, tl.minimum(pg_clip, cap), pg_clip)
    truncated = tl.minimum(w, eps_high)
    tau = tl.where(adv > 0, tau_pos, tau_neg)
    s = tl.sigmoid(tau * (w - 1.0))
    is_cispo = loss_kind == 1
    is_sapo = loss_kind == 2
    pg = tl.where(is_cispo, -truncated * adv * logp, tl.where(is_sapo, -s * 4.0 / tau * adv, pg_clip))
    d_pg = tl.where(is_cispo, -truncated * adv, tl.where(is_sapo, -4.0 * adv * s * (1.0 - s) * w, d_clip))
    d = ref - logp
    kl = tl.where(kl_kind == 1, -d, tl.where(kl_kind == 2, 0.5 * d * d, tl.exp(d) - d - 1.0))
    d_kl = tl.where(kl_kind == 1, 1.0, tl.where(kl_kind == 2, -d, 1.0 - tl.exp(d)))
    d_kl = tl.where(kl_bias != 0, w * (kl + d_kl), d_kl)
    kl = tl.where(kl_bias != 0, w * kl, kl)
    low = (w < 1.0 - eps_low) & (adv < 0) & (loss_kind != 1)  # CISPO clips no low side
    high = (w > tl.where(is_cispo, eps_high, 1.0 + eps_high)) & (adv > 0)
    return pg, d_pg, kl, d_kl, w, low, high


@triton.jit(do_not_specialize=["N", "T", "loss_kind", "kl_kind", "kl_bias", "has_old", "has_ref"])
def _grpo_loss_fwd_kernel(
    logits_ptr,  # [B, T, V], any strides
    stride_b,
    stride_t,
    stride_v,
    grad_ptr,  # [B, T, V] dL/dlogits out, any strides (may be logits_ptr); unused without WRITE_GRAD
    stride_gb,
    stride_gt,
    stride_gv,
    ids_ptr,  # [N] token ids, N = B * T
    mask_ptr,  # [N] mask m; 0 = padding: no sweep, zero gradient
    adv_ptr,  # [N] advantages
    old_ptr,  # [N] old log-probs, read only if has_old
    ref_ptr,  # [N] reference log-probs, read only if has_ref
    pg_weight_ptr,  # [N] aggregation weight * importance weight
    kl_weight_ptr,  # [N] aggregation weight * beta, read only if has_ref
    pieces_ptr,  # [6 or 7, N] out, per token: loss term, then m * (kl, low, high, low | high, w[, entropy]);
    #              its dtype (float32, float64 for float64 logits) is the accumulation dtype
    N,
    T,
    V,
    inv_tau,
    eps_low,
    eps_high,
    delta,  # +inf when unused
    dual_clip,  # +inf when unused
    tau_pos,
    tau_neg,
    loss_kind,  # 0 clipped, 1 cispo, 2 sapo
    kl_kind,  # 0 k3, 1 k1, 2 k2
    kl_bias,  # 1: the KL term is multiplied by the ratio w (bias-corrected)
    has_old,
    has_ref,
    BLOCK_V: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    acc = pieces_ptr.dtype.element_ty
    # Rows in flight = programs: fewer programs than rows loop over rows, so that the rows being
    # swept (twice) fit in L2 (a launcher knob, measured by benchmarks/gpu/bench_kernels.py).
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        b = (row // T).to(tl.int64)
        t = (row % T).to(tl.int64)
        row_ptr = logits_ptr + b * stride_b + t * stride_t
        tok = tl.load(ids_ptr + row).to(tl.int64)
        m = tl.load(mask_ptr + row)
        # Padding keeps these zeros: no sweep, and a zero coefficient makes _row_grad write zeros unread.
        lse = tl.full([], 0.0, acc)
        coef = tl.full([], 0.0, acc)
        term = tl.full([], 0.0, acc)
        kl = tl.full([], 0.0, acc)
        low = tl.full([], 0.0, acc)
        high = tl.full([], 0.0, acc)
        w = tl.full([], 0.0, acc)
        entropy = tl.full([], 0.0, acc)
        if m != 0.0:
            lse, mean_x = _row_logsumexp(row_ptr, stride_v, V, inv_tau, acc, BLOCK_V, RETURN_ENTROPY)
            logp = tl.load(row_ptr + tok * stride_v).to(acc) * inv_tau - lse
            entropy = lse - mean_x
            old = tl.load(old_ptr + row, mask=has_old != 0, other=0.0)
            ref = tl.load(ref_ptr + row, mask=has_ref != 0, other=0.0)
            pg, d_pg, kl, d_kl, w, is_low, is_high = _policy_terms(
                logp,
                old,
                tl.load(adv_ptr + row),
                ref,
                has_old,
                eps_low,
                eps_high,
                delta,
                dual_clip,
                tau_pos,
                tau_neg,
                loss_kind,
                kl_kind,
                kl_bias,
            )
            pg_weight = tl.load(pg_weight_ptr + row)
            kl_weight = tl.load(kl_weight_ptr + row, mask=has_ref != 0, other=0.0)
            use_kl = kl_weight != 0.0  # beta = 0: the KL term is absent, not 0 * inf from exp(d)
            term = (pg_weight * pg + tl.where(use_kl, kl_weight * kl, 0.0)).to(acc)
            coef = ((pg_weight * d_pg + tl.where(use_kl, kl_weight * d_kl, 0.0)) * inv_tau).to(acc)
            kl = tl.where(has_ref != 0, kl, 0.0).to(acc)
            low = tl.where(is_low, 1.0, 0.0).to(acc)
            high = tl.where(is_high, 1.0, 0.0).to(acc)
        tl.store(pieces_ptr + row, term)
        tl.store(pieces_ptr + N + row, m * kl)
        tl.store(pieces_ptr + 2 * N + row, m * low)
        tl.store(pieces_ptr + 3 * N + row, m * high)
        tl.store(pieces_ptr + 4 * N + row, m * tl.maximum(low, high))
        tl.store(pieces_ptr + 5 * N + row, m * w)
        if RETURN_ENTROPY:
            tl.store(pieces_ptr + 6 * N + row, m * entropy)
        if WRITE_GRAD:
            out_ptr = grad_ptr + b * stride_gb + t * stride_gt
            _row_grad(row_ptr, stride_v, out_ptr, stride_gv, V, inv_tau, lse, coef, tok, BLOCK_V)


@triton.jit(do_not_specialize=["T"])
def _scale_grad_kernel(
    grad_ptr,  # [B, T, V], any strides, scaled in place
    stride_b,
    stride_t,
    stride_v,
    scale_ptr,  # [1] the incoming gradient of the loss
    T,
    V,
    BLOCK_V: tl.constexpr,
):
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        row = tl.program_id(0)
        row_ptr = grad_ptr + (row // T).to(tl.int64) * stride_b + (row % T).to(tl.int64) * stride_t
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ptrs = row_ptr + cols.to(tl.int64) * stride_v
            g = tl.load(ptrs, mask=cols < V, other=0.0).to(scale.dtype)
            tl.store(ptrs, (g * scale).to(grad_ptr.dtype.element_ty), mask=cols < V)


def grpo_loss_fwd(
    logits: torch.Tensor,
    ids: torch.Tensor,
    batch,
    config,
    grad: torch.Tensor | None,
    *,
    return_entropy: bool = False,
    block_v: int | None = None,
    programs: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """One launch over logits [B, T, V]: returns the per-token pieces [6 or 7, B * T] (the
    weighted loss terms, then the masked kl, low, high, region, ratio[, entropy]) and writes
    dL/dlogits into ``grad`` [B, T, V] (any strides, may be the logits) unless it is None.

    ``batch`` is the loss's prepared per-token inputs as flat [B * T] arrays (mask, weights,
    adv, iw, old, ref; ``grpo_fast.ops.policy.PolicyBatch``) and ``config`` its
    ``LossConfig``, whose loss type and KL estimator give the kernel's branches.
    ``block_v``, ``programs`` (rows in flight; default one program per row) and ``warps``
    are launch knobs, not semantics."""
    B, T, V = logits.shape
    N = B * T
    m = batch.mask
    pieces = torch.empty(7 if return_entropy else 6, N, dtype=m.dtype, device=logits.device)  # every row written
    if N == 0:
        return pieces
    pg_weight = batch.weights if batch.iw is None else batch.weights * batch.iw
    kl_weight = batch.weights * config.beta
    g = logits if grad is None else grad
    block = block_size(V, block_v, max(logits.stride(2), g.stride(2)))
    inf = float("inf")
    absent = batch.adv  # any valid pointer for an input the kernel does not read
    with device_guard(logits):
        _grpo_loss_fwd_kernel[(min(N, programs or N),)](
            logits,
            *logits.stride(),
            g,
            *g.stride(),
            ids.reshape(-1).contiguous(),
            m,
            batch.adv,
            absent if batch.old is None else batch.old,
            absent if batch.ref is None else batch.ref,
            pg_weight,
            kl_weight,
            pieces,
            N,
            T,
            V,
            1.0 / config.temperature,
            float(config.eps_low),
            float(config.clip_high),
            inf if config.delta is None else float(config.delta),
            inf if config.dual_clip is None else float(config.dual_clip),
            float(config.sapo_tau_pos),
            float(config.sapo_tau_neg),
            config.kind.kernel_kind,
            config.kl.kernel_kind,
            int(config.kl_bias_correction),
            int(batch.old is not None),
            int(batch.ref is not None),
            BLOCK_V=block,
            RETURN_ENTROPY=return_entropy,
            WRITE_GRAD=grad is not None,
            num_warps=warps or num_warps(block),
        )
    return pieces


def scale_grad_(grad: torch.Tensor, scale: torch.Tensor, block_v: int | None = None) -> torch.Tensor:
    """grad [B, T, V] *= scale (a one-element device tensor), skipped on the device when it is 1."""
    B, T, V = grad.shape
    if B * T == 0:
        return grad
    block = block_size(V, block_v, grad.stride(2))
    with device_guard(grad):
        _scale_grad_kernel[(B * T,)](
            grad, *grad.stride(), scale.reshape(1), T, V, BLOCK_V=block, num_warps=num_warps(block)
        )
    return grad
