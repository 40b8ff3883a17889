"""The reference itself against a scalar, loop-by-loop transcription of the published formulas
(TRL's GRPOTrainer._compute_loss, DAPO, Dr. GRPO, GSPO, CISPO, SAPO, verl's dual clip).

The fused backends are tested against the reference; this file keeps the reference honest.
"""

import math

import pytest
import torch

from grpo_fast import reference


def scalar_loss(
    logp,
    old,
    ref,
    adv,
    mask,
    *,
    beta=0.0,
    eps_low=0.2,
    eps_high=None,
    delta=None,
    loss_type="grpo",
    level="token",
    L=None,
    n_items=None,
    dual_clip=None,
    iw=None,
    kl="k3",
    tau_pos=1.0,
    tau_neg=1.05,
):
    """One token at a time, with Python floats."""
    eps_high = eps_low if eps_high is None else eps_high
    B, T = len(logp), len(logp[0])
    rows = []
    for b in range(B):
        n_b = sum(mask[b])
        seq_log_ratio = sum(mask[b][t] * (logp[b][t] - old[b][t]) for t in range(T)) / max(n_b, 1)
        row = []
        for t in range(T):
            a = adv[b]
            w = math.exp(seq_log_ratio if level == "sequence" else logp[b][t] - old[b][t])
            if loss_type == "cispo":
                pg = -min(w, eps_high) * a * logp[b][t]
            elif loss_type == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                pg = -(1 / (1 + math.exp(-tau * (w - 1)))) * 4 / tau * a
            else:
                w1 = min(w, delta) if delta is not None else w
                w2 = min(max(w, 1 - eps_low), 1 + eps_high)
                pg = -min(w1 * a, w2 * a)
                if dual_clip is not None and a < 0:
                    pg = min(pg, -a * dual_clip)
            if iw is not None:
                pg *= iw[b]
            d = ref[b][t] - logp[b][t]
            k = {"k3": math.exp(d) - d - 1, "k1": -d, "k2": d * d / 2}[kl]
            row.append((pg + beta * k) * mask[b][t])
        rows.append(row)
    total = sum(map(sum, rows))
    n = sum(map(sum, mask))
    if loss_type in ("grpo", "sapo"):
        return sum(sum(r) / max(sum(m), 1) for r, m in zip(rows, mask)) / B
    if loss_type == "bnpo":
        return total / max(n, 1)
    if loss_type == "dr_grpo":
        return total / (B * L)
    if loss_type in ("dapo", "cispo"):
        return total / (n if n_items is None else n_items)
    return sum(sum(r) for r in rows) / B  # luspo


CASES = {
    "grpo_kl": dict(beta=0.04),
    "grpo_asym_kl1": dict(eps_high=0.28, beta=0.1, kl="k1"),
    "bnpo_k2": dict(loss_type="bnpo", beta=0.1, kl="k2"),
    "dr_grpo": dict(loss_type="dr_grpo", L=9),
    "dapo": dict(loss_type="dapo", eps_high=0.28),
    "dapo_items": dict(loss_type="dapo", n_items=30),
    "luspo": dict(loss_type="luspo"),
    "gspo": dict(level="sequence", beta=0.04),
    "luspo_gspo": dict(loss_type="luspo", level="sequence"),
    "cispo": dict(loss_type="cispo", eps_high=1.1),
    "sapo": dict(loss_type="sapo"),
    "sapo_seq": dict(loss_type="sapo", level="sequence", tau_pos=2.0, tau_neg=0.5),
    "delta": dict(delta=1.3),
    "dual_clip": dict(dual_clip=1.5, beta=0.04),
    "importance_weights": dict(iw=[0.5, 1.0, 0.9, 0.2]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_reference_matches_scalar_transcription(case):
    options = CASES[case]
    g = torch.Generator().manual_seed(1)
    B, T = 4, 6
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.2
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.3, -0.7, 0.4, -2.0], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[2, 3:] = 0
    mask[3] = 0  # an empty row

    want = scalar_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), **options)
    renames = dict(
        level="importance_sampling",
        L="max_completion_length",
        n_items="num_items_in_batch",
        kl="kl_estimator",
        tau_pos="sapo_tau_pos",
        tau_neg="sapo_tau_neg",
        iw="importance_weights",
    )
    kwargs = {renames.get(k, k): v for k, v in options.items()}
    if "importance_weights" in kwargs:
        kwargs["importance_weights"] = torch.tensor(kwargs["importance_weights"], dtype=torch.float64)
    got = reference.policy_loss(logp, adv, mask, old, ref, **kwargs)
    assert got.loss.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_reference_clip_metrics_follow_trl():
    """low: w < 1 - eps_low with A < 0; high: w > 1 + eps_high with A > 0; over active tokens."""
    logp = torch.zeros(2, 4, dtype=torch.float64)
    old = -torch.log(torch.tensor([[0.5, 1.5, 1.0, 2.0], [0.5, 1.5, 1.0, 2.0]], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    out = reference.policy_loss(logp, adv, mask, old, eps_low=0.2, eps_high=0.28)
    assert out.clip_ratio_high.item() == pytest.approx(1 / 7)  # row 0, ratio 1.5 (2.0 is masked)
    assert out.clip_ratio_low.item() == pytest.approx(1 / 7)  # row 1, ratio 0.5
    assert out.clip_ratio_region.item() == pytest.approx(2 / 7)
    assert out.ratio_mean.item() == pytest.approx((0.5 + 1.5 + 1 + 0.5 + 1.5 + 1 + 2) / 7)


def test_on_policy_gradient_is_the_advantage():
    """old_logprobs=None: ratio 1 but the gradient still flows, dL/dlogp = -A / |o| (grpo)."""
    logp = (-torch.rand(2, 3, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    out = reference.policy_loss(logp, adv)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    assert torch.allclose(grad, (-adv / 3 / 2).unsqueeze(1).expand(2, 3))
