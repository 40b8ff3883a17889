"""Parity of the public ops with the reference, on every backend, across regimes and awkward sizes.

Shapes are tiny (the Triton backend runs under the interpreter in CI); V values are chosen
off powers of two. Each regime asserts that it really exercises what it names (e.g. the
clipped regime has clipped tokens of both signs of A), so no case passes vacuously.
"""

import importlib
import math

import pytest
import torch
from conftest import METRICS, assert_metrics_match, batch_args, make_case, max_err, rel_err

import grpo_fast
from grpo_fast import reference
from grpo_fast.spec import LOSS_TYPES


def check_against_reference(case, tol, **options):
    """Loss, logits gradient and every metric of the op vs the reference in float64."""
    logits = case["logits"].detach().requires_grad_()
    args = batch_args(case)
    out = grpo_fast.grpo_loss(logits, *args, **options)
    (grad,) = torch.autograd.grad(out.loss, logits)

    ref_logits = case["logits"].detach().double().requires_grad_()
    expected = reference.grpo_loss(ref_logits, *args, **options)
    (ref_grad,) = torch.autograd.grad(expected.loss, ref_logits)

    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert rel_err(out.loss, expected.loss) < tol
    assert rel_err(grad, ref_grad) < tol and max_err(grad, ref_grad) < tol
    assert_metrics_match(out, expected, tol)
    return out


def one_loss_type_per_kernel_kind() -> list:
    """The Triton kernel branches on a loss type's ``kernel_kind`` only: the aggregation (token
    weights) and the sequence-level path are PyTorch shared with the torch backend. So the slow
    interpreter runs one loss type per kind; the torch backend runs every type."""
    first = {}
    for name, kind in LOSS_TYPES.items():
        first.setdefault(kind.kernel_kind, name)
    return list(first.values())


@pytest.mark.parametrize("kl", [None, "k3"], ids=["no_kl", "kl"])
@pytest.mark.parametrize("regime", ["on_policy", "unclipped", "clipped"])
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize(
    "backend, loss_type",
    [("torch", t) for t in LOSS_TYPES]
    + [(b, t) for b in ("compiled", "triton") for t in one_loss_type_per_kernel_kind()],
    indirect=["backend"],
)
def test_grpo_loss_matrix(backend, loss_type, importance_sampling, regime, kl):
    case = make_case(regime=regime)
    options = dict(loss_type=loss_type, importance_sampling=importance_sampling, max_completion_length=8)
    if loss_type == "cispo":
        options["eps_high"] = 1.2  # CISPO's cap on the ratio, crossed in the clipped regime
    else:
        options["eps_high"] = 0.28
    if kl is None:
        case["ref_logprobs"] = None
    else:
        options.update(beta=0.04, kl_estimator=kl)
    out = check_against_reference(case, 1e-5, **options)
    if regime == "clipped" and importance_sampling == "token" and loss_type != "sapo":
        assert out.clip_ratio_high > 0  # the regime does what it says
        if loss_type != "cispo":
            assert out.clip_ratio_low > 0
    if regime != "clipped" and loss_type != "cispo":
        assert out.clip_ratio_region == 0


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, beta=0.1, kl_estimator="k1"),
        dict(beta=0.1, kl_estimator="k2"),
        dict(delta=1.5),
        dict(dual_clip=3.0),
        dict(loss_type="bnpo", dual_clip=1.5, delta=1.3, eps_high=0.28),
        dict(loss_type="dapo", num_items_in_batch=40),
        dict(return_entropy=True),
        dict(loss_type="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5),
        dict(beta=0.1, kl_bias_correction=True),
        dict(loss_type="dapo", beta=0.1, kl_estimator="k2", kl_bias_correction=True),
    ],
    ids=[
        "temp0.7",
        "temp1.3_k1",
        "k2",
        "delta",
        "dual_clip",
        "bnpo_dual_delta",
        "dapo_num_items",
        "entropy",
        "sapo_tau",
        "kl_bias",
        "dapo_k2_kl_bias",
    ],
)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_grpo_loss_options(backend, options, importance_sampling):
    case = make_case(regime="clipped", seq_adv=False, seed=1)
    if options.get("beta", 0) == 0:
        case["ref_logprobs"] = None
    check_against_reference(case, 1e-5, importance_sampling=importance_sampling, **options)


@pytest.mark.parametrize("iw_shape", ["sequence", "token"])
def test_importance_weights(backend, iw_shape):
    case = make_case(regime="clipped", seed=2)
    B, T = case["ids"].shape
    iw = torch.rand(B) if iw_shape == "sequence" else torch.rand(B, T)
    check_against_reference(case, 1e-5, importance_weights=iw, beta=0.04)


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 5), (2, 1, 37), (4, 3, 129), (2, 7, 1000)],
    ids=["B1T1", "T1", "V129", "V1000"],
)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_odd_sizes_and_strides(backend, shape, strided):
    B, T, V = shape
    case = make_case(B=max(B, 2), T=T, V=V, strided=strided, regime="clipped", seed=3)
    if strided:
        assert not case["logits"].is_contiguous()
    check_against_reference(case, 1e-5, beta=0.04, temperature=0.9, return_entropy=True)


def test_empty_mask_row_and_all_masked(backend):
    case = make_case(regime="clipped", seed=4)
    case["mask"][1] = 0
    out = check_against_reference(case, 1e-5, beta=0.04)
    assert torch.isfinite(out.loss)
    case["mask"].zero_()
    logits = case["logits"].detach().requires_grad_()
    out = grpo_fast.grpo_loss(
        logits, case["ids"], case["advantages"], case["mask"], beta=0.04, ref_logprobs=case["ref_logprobs"]
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and logits.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("num_items", [None, 0, "tensor0"])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "bnpo", "grpo"])
def test_all_masked_batch_is_zero_not_nan(backend, loss_type, num_items):
    """Every completion masked (e.g. all truncated and masked): loss 0 and gradient 0, never
    NaN, as TRL and Liger clamp the normaliser; a num_items_in_batch of 0 counts as 1."""
    case = make_case(regime="clipped", seed=11)
    case["mask"].zero_()
    logits = case["logits"].detach().requires_grad_()
    n = torch.tensor(0.0) if num_items == "tensor0" else num_items
    out = grpo_fast.grpo_loss(
        logits,
        *batch_args(case),
        loss_type=loss_type,
        beta=0.04,
        num_items_in_batch=n,
        eps_high=5.0 if loss_type == "cispo" else None,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and logits.grad.abs().max().item() == 0.0
    assert all(getattr(out, k).item() == 0.0 for k in ("kl", "clip_ratio_low", "clip_ratio_high", "ratio_mean"))


def test_bias_corrected_kl_gradient_on_policy(backend):
    """On-policy (ratio 1) the bias-corrected KL has the plain KL's value but not its gradient:
    d(w kl)/dlogp = kl + dkl/dlogp at w = 1 (TRL's use_bias_correction_kl)."""
    case = make_case(regime="on_policy", seed=12)
    grads = []
    for corrected in (False, True):
        out = check_against_reference(case, 1e-5, beta=0.1, kl_bias_correction=corrected)
        logits = case["logits"].detach().requires_grad_()
        args = (case["ids"], case["advantages"], case["mask"], None, case["ref_logprobs"])
        (grad,) = torch.autograd.grad(
            grpo_fast.grpo_loss(logits, *args, beta=0.1, kl_bias_correction=corrected).loss, logits
        )
        grads.append((out.loss.item(), grad))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    assert rel_err(grads[1][1], grads[0][1]) > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(backend, dtype):
    """bf16/fp16 logits vs the reference on the same values upcast: relative error < 1e-2."""
    case = make_case(B=4, T=6, V=300, regime="clipped", dtype=dtype, seed=5)
    check_against_reference(case, 1e-2, beta=0.04, temperature=0.8, return_entropy=True)


def test_float64_is_exact(backend):
    case = make_case(regime="clipped", dtype=torch.float64, seed=6)
    check_against_reference(case, 1e-12, beta=0.04, return_entropy=True)


def test_token_logprobs_matches_reference_and_is_nonpositive(backend):
    case = make_case(B=3, T=4, V=101, strided=True, seed=7)
    logits = case["logits"].detach().requires_grad_()
    logp, entropy = grpo_fast.token_logprobs(logits, case["ids"], temperature=0.8, return_entropy=True)
    ref_logits = case["logits"].detach().double().requires_grad_()
    ref_logp, ref_entropy = reference.token_logprobs(ref_logits, case["ids"], temperature=0.8, return_entropy=True)
    assert logp.dtype == torch.float32 and logp.shape == case["ids"].shape
    assert (logp <= 0).all()
    assert rel_err(logp, ref_logp) < 1e-6 and rel_err(entropy, ref_entropy) < 1e-6
    assert not entropy.requires_grad
    weights = torch.randn_like(logp)
    (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_logp * weights.double()).sum(), ref_logits)
    assert rel_err(grad, ref_grad) < 1e-5 and max_err(grad, ref_grad) < 1e-5


def test_token_logprobs_extreme_logits(backend):
    """Very peaked and -inf (padded vocabulary) logits stay finite and <= 0."""
    logits = torch.randn(2, 3, 50) * 50
    logits[..., 40:] = float("-inf")
    ids = torch.randint(0, 40, (2, 3))
    logp = grpo_fast.token_logprobs(logits, ids)
    ref = reference.token_logprobs(logits.double(), ids)
    assert torch.isfinite(logp).all() and (logp <= 0).all()
    assert rel_err(logp, ref) < 1e-6


def test_inplace_backward_reuses_logits_buffer(backend):
    """inplace_backward writes dL/dlogits into the logits' own storage (logits here come out of
    an LM head, as in training) and upstream gradients are unchanged."""
    case = make_case(B=2, T=4, V=77, regime="clipped", seed=8)
    hidden = torch.randn(2, 4, 16)
    weight = torch.randn(77, 16) / 4
    args = (case["ids"], case["advantages"], case["mask"], case["old_logprobs"])

    def run(inplace):
        w = weight.clone().requires_grad_()
        logits = hidden @ w.T
        logits.retain_grad() if not inplace else None
        grpo_fast.grpo_loss(logits, *args, inplace_backward=inplace).loss.backward()
        return w.grad, logits

    expected_wgrad, expected_logits = run(False)
    wgrad, logits = run(True)
    assert rel_err(wgrad, expected_wgrad) < 1e-6 and max_err(wgrad, expected_wgrad) < 1e-6
    assert (
        rel_err(logits.detach(), expected_logits.grad) < 1e-6 and max_err(logits.detach(), expected_logits.grad) < 1e-6
    )  # the buffer now holds the gradient


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_dapo_microbatch_split_gives_same_gradient(backend, loss_type):
    """With the global token count as num_items_in_batch, summed micro-batch gradients
    equal the full-batch gradient, whatever the split."""
    case = make_case(B=4, T=5, V=53, regime="clipped", seq_adv=False, seed=9)
    n_items = case["mask"].sum()
    options = dict(
        loss_type=loss_type, num_items_in_batch=n_items, beta=0.04, eps_high=1.5 if loss_type == "cispo" else 0.2
    )
    keys = ("ids", "advantages", "mask", "old_logprobs", "ref_logprobs")

    full = case["logits"].detach().requires_grad_()
    grpo_fast.grpo_loss(full, *(case[k] for k in keys), **options).loss.backward()

    split = case["logits"].detach().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):
        grpo_fast.grpo_loss(split[rows], *(case[k][rows] for k in keys), **options).loss.backward()
    assert rel_err(split.grad, full.grad) < 1e-6 and max_err(split.grad, full.grad) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)  # compiled: the test below
def test_no_float32_vocab_sized_temporaries(backend, monkeypatch):
    """The fused path never materialises a float32 [B, T, V] tensor (the reference does)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch_path = importlib.import_module("grpo_fast.ops.token_logprobs")  # the module, not the op
    monkeypatch.setattr(torch_path, "CHUNK_BYTES", 1 << 18)  # chunks of 16 rows: small test, many chunks

    class LargestFloat32(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.largest = max(self.largest, t.numel())
            return out

    B, T, V = 8, 64, 4096
    case = make_case(B=B, T=T, V=V, dtype=torch.bfloat16, regime="clipped", seed=10)
    logits = case["logits"].detach().requires_grad_()
    with LargestFloat32() as mode:
        out = grpo_fast.grpo_loss(
            logits,
            *batch_args(case),
            beta=0.04,
            return_entropy=True,
        )
        out.loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    assert mode.largest < B * T * V // 4, mode.largest

    with LargestFloat32() as ref_mode:
        reference.grpo_loss(logits, case["ids"], case["advantages"], case["mask"]).loss.backward()
    assert ref_mode.largest >= B * T * V  # the check can fail: the reference trips it


def test_compiled_cpu_path_holds_no_float32_copy(monkeypatch):
    """The kernels inductor builds for the CPU path hold nothing [B, T, V] in float32: a loss
    forward and backward on bf16 logits raises the process's peak RSS by about the bf16
    gradient, where the eager two-liner needs float32 copies (measured by the kernel's
    high-water mark, so compiled code is seen as it runs; a dispatch mode would not see it)."""
    from grpo_fast.bench.measure import peak_rss_growth

    monkeypatch.setenv("GRPO_FAST_BACKEND", "torch")
    monkeypatch.setenv("GRPO_FAST_CPU_COMPILE", "1")
    B, T, V = 4, 512, 16384
    float32_copy = B * T * V * 4
    case = make_case(B=B, T=T, V=V, dtype=torch.bfloat16, regime="clipped", seed=3)

    def fused_step(case):
        logits = case["logits"].detach().requires_grad_()
        out = grpo_fast.grpo_loss(logits, *batch_args(case), beta=0.04, return_entropy=True)
        torch.autograd.grad(out.loss, logits)

    def plain_step(logits):
        logits.requires_grad_()
        logp = torch.log_softmax(logits.float(), -1).gather(-1, case["ids"].unsqueeze(-1)).squeeze(-1)
        torch.autograd.grad((logp * case["advantages"].unsqueeze(1)).sum(), logits)

    fused_step(make_case(B=2, T=8, V=V, dtype=torch.bfloat16))  # compiles on a small block first
    fused = peak_rss_growth(lambda: fused_step(case), reset=True)
    plain = peak_rss_growth(lambda: plain_step(case["logits"].detach()), reset=True)
    assert fused < float32_copy * 3 // 4, (fused, float32_copy)  # the bf16 gradient is half a copy
    assert plain >= float32_copy, (plain, float32_copy)  # the check can fail: the two-liner trips it


# ----------------------------------------------------------------------------- bad input


def _good_args():
    case = make_case(B=2, T=3, V=11)
    return case, dict(loss_type="grpo")


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda c, o: c.update(logits=c["logits"][0]), ValueError, "logits must have 3 dimensions"),
        (lambda c, o: c.update(logits=c["logits"].long()), TypeError, "logits must be a floating"),
        (lambda c, o: c.update(ids=c["ids"].float()), TypeError, "ids must be an integer"),
        (lambda c, o: c.update(ids=c["ids"][:, :2]), ValueError, r"ids must have shape \[2, 3\]"),
        (lambda c, o: c.update(ids=c["ids"] + 11), ValueError, r"ids must lie in \[0, V\)"),
        (lambda c, o: c.update(ids=c["ids"] - 11), ValueError, r"ids must lie in \[0, V\)"),
        (lambda c, o: c.update(advantages=torch.randn(3)), ValueError, r"advantages must have shape \[2, 3\] or \[2\]"),
        (lambda c, o: c.update(mask=torch.ones(2, 4)), ValueError, r"mask must have shape \[2, 3\]"),
        (lambda c, o: c.update(old_logprobs=torch.zeros(3, 2)), ValueError, "old_logprobs must have shape"),
        (lambda c, o: o.update(loss_type="ppo"), ValueError, "loss_type must be one of"),
        (lambda c, o: o.update(importance_sampling="seq"), ValueError, "importance_sampling must be one of"),
        (lambda c, o: o.update(kl_estimator="k4"), ValueError, "kl_estimator must be one of"),
        (lambda c, o: o.update(temperature=0.0), ValueError, "temperature must be"),
        (lambda c, o: o.update(temperature=-1.0), ValueError, "temperature must be"),
        (lambda c, o: o.update(eps_low=-0.1), ValueError, "eps_low must be"),
        (lambda c, o: o.update(eps_high=-0.1), ValueError, "eps_high must be"),
        (lambda c, o: (c.update(ref_logprobs=None), o.update(beta=0.1)), ValueError, "ref_logprobs .* required"),
        (lambda c, o: o.update(loss_type="dr_grpo"), ValueError, "max_completion_length is required"),
        (lambda c, o: o.update(delta=0.5), ValueError, "delta must be"),
        (lambda c, o: o.update(dual_clip=1.0), ValueError, "dual_clip must be"),
        (lambda c, o: o.update(importance_weights=torch.ones(5)), ValueError, "importance_weights must have shape"),
        (lambda c, o: o.update(num_items_in_batch=-1), ValueError, "num_items_in_batch must be"),
        (lambda c, o: o.update(num_items_in_batch=torch.tensor(-2.0)), ValueError, "num_items_in_batch must be"),
    ],
)
def test_bad_input(backend, mutate, error, match):
    case, options = _good_args()
    mutate(case, options)
    with pytest.raises(error, match=match):
        grpo_fast.grpo_loss(
            case["logits"],
            *batch_args(case),
            **options,
        )


def test_bad_input_token_logprobs(backend):
    logits = torch.randn(2, 3, 7)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        grpo_fast.token_logprobs(logits.tolist(), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids must have shape \[2, 3\]"):
        grpo_fast.token_logprobs(logits, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        grpo_fast.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=math.inf)


# ----------------------------------------------------------------------------- policy_loss


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_from_logprobs_matches_reference(backend, loss_type, importance_sampling):
    """The loss from log-probs the caller already has: value, gradient and metrics as the reference's."""
    case = make_case(regime="clipped", seq_adv=False, seed=13)
    logp64 = reference.token_logprobs(case["logits"].double(), case["ids"]).requires_grad_()
    entropy = torch.rand(logp64.shape, dtype=torch.float64)
    args = (case["advantages"], case["mask"], case["old_logprobs"], case["ref_logprobs"])
    options = dict(
        loss_type=loss_type,
        importance_sampling=importance_sampling,
        max_completion_length=8,
        beta=0.04,
        eps_high=1.2 if loss_type == "cispo" else 0.28,
        kl_bias_correction=True,
    )
    logp = logp64.detach().float().requires_grad_()
    out = grpo_fast.policy_loss(logp, *args, entropy=entropy.float(), **options)
    (grad,) = torch.autograd.grad(out.loss, logp)
    want = reference.policy_loss(logp64, *args, entropy=entropy, **options)
    (want_grad,) = torch.autograd.grad(want.loss, logp64)
    assert rel_err(out.loss, want.loss) < 1e-5 and rel_err(grad, want_grad) < 1e-5 and max_err(grad, want_grad) < 1e-5
    for name in METRICS:
        assert abs(getattr(out, name).item() - getattr(want, name).item()) < 1e-5, name


def test_policy_loss_bad_input():
    with pytest.raises(ValueError, match="logprobs must have 2 dimensions"):
        grpo_fast.policy_loss(torch.zeros(2, 3, 4), torch.zeros(2))
    with pytest.raises(ValueError, match=r"advantages must have shape \[2, 3\] or \[2\]"):
        grpo_fast.policy_loss(torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"entropy must have shape \[B, T\]"):
        grpo_fast.policy_loss(torch.zeros(2, 3), torch.zeros(2), entropy=torch.zeros(3))


def test_padding_holds_anything(backend):
    """What padded positions hold (an overflowing reference log-prob, -inf and NaN old
    log-probs and advantages) reaches neither the loss, the metrics nor the gradient."""
    case = make_case(regime="clipped", seq_adv=False, seed=14)
    want = check_against_reference(case, 1e-5, beta=0.04, return_entropy=True)
    pad = case["mask"] == 0
    assert pad.any()
    for key, value in (("ref_logprobs", 100.0), ("old_logprobs", -math.inf), ("advantages", math.nan)):
        case[key] = case[key].masked_fill(pad, value)
    out = check_against_reference(case, 1e-5, beta=0.04, return_entropy=True)
    assert out.loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    hidden = torch.randn(*case["ids"].shape, 8, requires_grad=True)
    weight = torch.randn(case["logits"].shape[-1], 8, requires_grad=True)
    args = batch_args(case)
    fused = grpo_fast.fused_linear_grpo_loss(hidden, weight, *args, beta=0.04, importance_sampling="sequence")
    fused.loss.backward()
    assert torch.isfinite(fused.loss) and torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
