"""The token-level GRPO loss in one launch: log-probs, policy math and dL/dlogits together.

Order: the per-token gradient of the policy term, the forward kernel, the gradient-rescale
kernel, the launcher, the autograd.Function, the entry point ``grpo_loss_triton`` that
``grpo_fast.ops.grpo_loss`` dispatches to for ``importance_sampling="token"``.

The loss is terminal, so once a row's log-sum-exp is known so is its coefficient
``c = dL/dlogp`` and the same program writes ``dL/dlogits = c * (onehot(id) - p) / tau``:
the logits are swept twice by one program (the second sweep, last block first, mostly hits
L2) and the gradient is written once. With L = sum_t weight_t * (iw_t * pg_t + beta * kl_t):

    c_t = weight_t * iw_t * dpg_t/dlogp + weight_t * beta * dkl_t/dlogp

where weight_t = dL/dper_token_t is the aggregation (grpo: m / (B * len_b), bnpo: m / sum m,
...), computed in torch on [B, T] like every other per-variant reduction. The kernel only
differentiates the per-token terms (derivation beside ``_policy_grads``); the loss value and
the metrics come from ``reference.policy_loss`` on the kernel's log-probs, the spec itself.
Backward only multiplies by the incoming gradient, and only when it is not 1, deciding on
the device (no host sync).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from grpo_fast import reference
from grpo_fast.kernels.token_logprobs import _row_grad, _row_logsumexp, accumulate_dtype, block_size, num_warps
from grpo_fast.outputs import LossOutput

LOSS_KINDS = {"cispo": 1, "sapo": 2}  # every other loss type is the clipped family, kind 0
KL_KINDS = {"k3": 0, "k1": 1, "k2": 2}


@triton.jit
def _policy_grads(
    logp, old, adv, ref, has_old, eps_low, eps_high, delta, dual_clip, tau_pos, tau_neg, loss_kind, kl_kind
):
    """(d pg / dlogp, d kl / dlogp) for one token, with torch's subgradients at ties.

    w = exp(logp - old) (1 on-policy, where old = logp.detach()), dw/dlogp = w.
    clipped: pg = -min(w1 A, w2 A), w1 = min(w, delta), w2 = clamp(w, 1 - eps_low, 1 + eps_high);
             torch.min splits the gradient in half on ties, clamp passes it on its closed range.
             dual clip (A < 0): pg <- min(pg, -A c), the cap is constant in logp.
    cispo:   pg = -min(w, eps_high).detach() * A * logp        -> -min(w, eps_high) * A
    sapo:    pg = -sigmoid(tau (w - 1)) * 4 / tau * A          -> -4 A s (1 - s) w
    kl, d = ref - logp:  k3 exp(d) - d - 1 -> 1 - exp(d);  k1 -d -> 1;  k2 d^2 / 2 -> -d
    """
    w = tl.exp(tl.where(has_old != 0, logp - old, 0.0))
    w1 = tl.minimum(w, delta)
    dw1 = tl.where(w <= delta, w, 0.0)
    w2 = tl.minimum(tl.maximum(w, 1.0 - eps_low), 1.0 + eps_high)
    dw2 = tl.where((w >= 1.0 - eps_low) & (w <= 1.0 + eps_high), w, 0.0)
    a = w1 * adv
    b = w2 * adv
    d_clip = -adv * tl.where(a < b, dw1, tl.where(b < a, dw2, 0.5 * (dw1 + dw2)))
    pg = -tl.minimum(a, b)
    cap = -adv * dual_clip
    d_dual = tl.where(pg < cap, d_clip, tl.where(pg > cap, 0.0, 0.5 * d_clip))
    d_clip = tl.where(adv < 0, d_dual, d_clip)
    d_cispo = -tl.minimum(w, eps_high) * adv
    s = tl.sigmoid(tl.where(adv > 0, tau_pos, tau_neg) * (w - 1.0))
    d_sapo = -4.0 * adv * s * (1.0 - s) * w
    d_pg = tl.where(loss_kind == 1, d_cispo, tl.where(loss_kind == 2, d_sapo, d_clip))
    d = ref - logp
    d_kl = tl.where(kl_kind == 1, 1.0, tl.where(kl_kind == 2, -d, 1.0 - tl.exp(d)))
    return d_pg, d_kl


@triton.jit(do_not_specialize=["N", "T", "loss_kind", "kl_kind", "has_old", "has_ref"])
def _grpo_loss_fwd_kernel(
    logits_ptr,  # [B, T, V], any strides
    stride_b,
    stride_t,
    stride_v,
    grad_ptr,  # [B, T, V] dL/dlogits out, any strides (may be logits_ptr); unused without WRITE_GRAD
    stride_gb,
    stride_gt,
    stride_gv,
    ids_ptr,  # [B * T] token ids
    mask_ptr,  # [B * T], 0 = padding: no sweep, zero gradient
    adv_ptr,  # [B * T] advantages
    old_ptr,  # [B * T] old log-probs, read only if has_old
    ref_ptr,  # [B * T] reference log-probs, read only if has_ref
    pg_weight_ptr,  # [B * T] aggregation weight * importance weight
    kl_weight_ptr,  # [B * T] aggregation weight * beta, read only if has_ref
    logp_ptr,  # [B * T] out (0 at padding); its dtype (float32, float64 for float64 logits) is
    #            the accumulation dtype, as of every [B * T] input
    entropy_ptr,  # [B * T] out, as logp; unused without RETURN_ENTROPY
    N,  # B * T rows
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
    has_old,
    has_ref,
    BLOCK_V: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    # Rows in flight = programs: fewer programs than rows loop over rows, so that the rows being
    # swept (twice) fit in L2 (a launcher knob, measured by benchmarks/gpu/bench_kernels.py).
    acc = logp_ptr.dtype.element_ty
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        b = (row // T).to(tl.int64)
        t = (row % T).to(tl.int64)
        row_ptr = logits_ptr + b * stride_b + t * stride_t
        out_ptr = grad_ptr + b * stride_gb + t * stride_gt
        tok = tl.load(ids_ptr + row).to(tl.int64)
        # Padding keeps these zeros: no sweep, and a zero coefficient makes _row_grad write zeros unread.
        lse = tl.full([], 0.0, acc)
        logp = tl.full([], 0.0, acc)
        entropy = tl.full([], 0.0, acc)
        coef = tl.full([], 0.0, acc)
        if tl.load(mask_ptr + row) != 0.0:
            lse, mean_x = _row_logsumexp(row_ptr, stride_v, V, inv_tau, acc, BLOCK_V, RETURN_ENTROPY)
            logp = tl.load(row_ptr + tok * stride_v).to(acc) * inv_tau - lse
            entropy = lse - mean_x
            if WRITE_GRAD:
                old = tl.load(old_ptr + row, mask=has_old != 0, other=0.0)
                ref = tl.load(ref_ptr + row, mask=has_ref != 0, other=0.0)
                d_pg, d_kl = _policy_grads(
                    logp, old, tl.load(adv_ptr + row), ref, has_old, eps_low, eps_high, delta, dual_clip,
                    tau_pos, tau_neg, loss_kind, kl_kind,
                )  # fmt: skip
                kl_weight = tl.load(kl_weight_ptr + row, mask=has_ref != 0, other=0.0)
                d_loss = tl.load(pg_weight_ptr + row) * d_pg + tl.where(kl_weight != 0.0, kl_weight * d_kl, 0.0)
                coef = (d_loss * inv_tau).to(acc)  # kl_weight = 0 (beta = 0): no 0 * inf from exp(d)
        tl.store(logp_ptr + row, logp)
        if RETURN_ENTROPY:
            tl.store(entropy_ptr + row, entropy)
        if WRITE_GRAD:
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


def _per_token(x: Optional[torch.Tensor], B: int, T: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """[B] or [B, T] -> [B * T] contiguous ``dtype`` (O(B*T): nothing of size V)."""
    if x is None:
        return None
    x = x.to(dtype)
    return (x.unsqueeze(1) if x.dim() == 1 else x).expand(B, T).reshape(-1).contiguous()


def aggregation_weights(m: torch.Tensor, loss_type: str, max_completion_length, num_items_in_batch) -> torch.Tensor:
    """dL/dper_token [B, T] of each aggregation (see DESIGN.md), 0 where the mask m [B, T] is 0."""
    B = m.shape[0]
    if loss_type in ("grpo", "sapo"):
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return m / (B * max_completion_length)
    if loss_type in ("dapo", "cispo"):
        n = m.sum() if num_items_in_batch is None else num_items_in_batch
        return m / torch.as_tensor(n, dtype=m.dtype, device=m.device)
    return m / B  # luspo


def grpo_loss_fwd(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    grad: Optional[torch.Tensor],
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    delta: Optional[float] = None,
    loss_type: str = "grpo",
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    importance_weights: Optional[torch.Tensor] = None,
    dual_clip: Optional[float] = None,
    kl_estimator: str = "k3",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    block_v: Optional[int] = None,
    programs: Optional[int] = None,
    warps: Optional[int] = None,
):
    """One launch over logits [B, T, V]: returns logp [B, T] (0 at padding) and entropy [B, T]
    or None, float32 (float64 for float64 logits); writes dL/dlogits into ``grad`` [B, T, V] (any strides, may be the
    logits) unless ``grad`` is None. ``block_v``, ``programs`` (rows in flight; default one
    program per row) and ``warps`` are launch knobs, not semantics."""
    B, T, V = logits.shape
    acc = accumulate_dtype(logits)
    m = torch.ones(B, T, dtype=acc, device=logits.device) if mask is None else mask.to(acc)
    weight = aggregation_weights(m, loss_type, max_completion_length, num_items_in_batch)
    pg_weight = weight if importance_weights is None else weight * _per_token(importance_weights, B, T, acc).view(B, T)
    adv = _per_token(advantages, B, T, acc)
    old = _per_token(old_logprobs, B, T, acc)
    use_kl = beta != 0.0
    ref = _per_token(ref_logprobs, B, T, acc) if use_kl else None
    logp = torch.empty(B, T, dtype=acc, device=logits.device)
    entropy = torch.empty_like(logp) if return_entropy else None
    if B * T == 0:
        return logp, entropy
    block = block_size(V, block_v)
    eps_high = eps_low if eps_high is None else eps_high
    inf = float("inf")
    g = logits if grad is None else grad
    _grpo_loss_fwd_kernel[(min(B * T, programs or B * T),)](
        logits, *logits.stride(), g, *g.stride(), ids.reshape(-1).contiguous(), m.reshape(-1).contiguous(),
        adv, adv if old is None else old, adv if ref is None else ref, pg_weight.reshape(-1).contiguous(),
        (weight * beta).reshape(-1).contiguous() if use_kl else adv, logp, logp if entropy is None else entropy,
        B * T, T, V, 1.0 / temperature, float(eps_low), float(eps_high), inf if delta is None else float(delta),
        inf if dual_clip is None else float(dual_clip), float(sapo_tau_pos), float(sapo_tau_neg),
        LOSS_KINDS.get(loss_type, 0), KL_KINDS[kl_estimator], int(old is not None), int(use_kl),
        BLOCK_V=block, RETURN_ENTROPY=return_entropy, WRITE_GRAD=grad is not None, num_warps=warps or num_warps(block),
    )  # fmt: skip
    return logp, entropy


def scale_grad_(grad: torch.Tensor, scale: torch.Tensor, block_v: Optional[int] = None) -> torch.Tensor:
    """grad [B, T, V] *= scale (a one-element device tensor), skipped on the device when it is 1."""
    B, T, V = grad.shape
    if B * T == 0:
        return grad
    block = block_size(V, block_v)
    _scale_grad_kernel[(B * T,)](
        grad, *grad.stride(), scale.reshape(1), T, V, BLOCK_V=block, num_warps=num_warps(block)
    )
    return grad


class FusedGradFunction(torch.autograd.Function):
    """Attaches dL/dlogits, already written by the forward kernel, to the loss value."""

    @staticmethod
    def forward(ctx, logits, loss, grad):
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return scale_grad_(grad, grad_loss), None, None


def grpo_loss_triton(
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
    """``grpo_fast.grpo_loss`` for ``importance_sampling="token"`` in one launch (arguments
    already validated; ``options`` are the policy-loss keywords of ``reference.policy_loss``).

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
    kernel_options = {k: v for k, v in options.items() if k != "importance_sampling"}
    logp, entropy = grpo_loss_fwd(
        logits.detach(), ids, advantages, mask, old_logprobs, ref_logprobs, grad,
        temperature=temperature, return_entropy=return_entropy, block_v=block_v, programs=programs, warps=warps,
        **kernel_options,
    )  # fmt: skip
    with torch.no_grad():
        out = reference.policy_loss(logp, advantages, mask, old_logprobs, ref_logprobs, entropy=entropy, **options)
    if not write_grad:
        return out
    return out._replace(loss=FusedGradFunction.apply(logits, out.loss, grad))
