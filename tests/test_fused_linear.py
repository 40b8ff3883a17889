"""fused_linear_grpo_loss and fused_linear_token_logprobs against the reference on materialised logits.

Every case compares the loss, the metrics and the gradients of hidden, weight and bias with
``reference.grpo_loss(hidden @ weight.T + bias)`` in float64, and with ``grpo_fast.grpo_loss``
on the same float32 logits. B * T = 15 so that the chunk sizes used (1, 4, 7) leave a
remainder; V = 37 is off powers of two; one row of the mask is half empty and one fully.
"""

import importlib

import pytest
import torch
from conftest import METRICS, assert_metrics_match, batch_args, max_err, rel_err

import grpo_fast
from grpo_fast import reference
from grpo_fast.spec import LOSS_TYPES

# The module, not the function of the same name that grpo_fast.ops exports.
fused_module = importlib.import_module("grpo_fast.ops.fused_linear_grpo_loss")


def make_linear_case(B=3, T=5, H=16, V=37, *, bias=True, dtype=torch.float32, seed=0, logit_scale=3.0):
    """Hidden states, LM head and a GRPO batch whose old log-probs put ratios on both sides of
    both clip bounds (log-ratios cycle through -0.6 .. 0.7), with both signs of A."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * logit_scale
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    logits = hidden @ weight.T + (0 if b is None else b)
    logp = reference.token_logprobs(logits, ids)
    pattern = torch.tensor([-0.6, 0.7, -0.1, 0.4, 0.05], dtype=torch.float64).repeat(T // 5 + 1)[:T]
    adv = torch.randn(B, generator=g)
    adv[0], adv[1] = abs(adv[0]) + 0.5, -abs(adv[1]) - 0.5
    mask = torch.ones(B, T)
    mask[-1, T // 2 :] = 0
    return dict(
        hidden=hidden.to(dtype),
        weight=weight.to(dtype),
        bias=None if b is None else b.to(dtype),
        ids=ids,
        advantages=adv,
        mask=mask,
        old_logprobs=(logp - pattern).float(),
        ref_logprobs=(logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).float(),
    )


def run_fused(case, **options):
    """Loss output and gradients (hidden, weight, bias or None) of the fused op."""
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    bias = None if case["bias"] is None else case["bias"].clone().requires_grad_()
    out = grpo_fast.fused_linear_grpo_loss(hidden, weight, *batch_args(case), bias=bias, **options)
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    grads = torch.autograd.grad(out.loss, inputs)
    return out, grads


def run_materialised(case, loss_fn, dtype, **options):
    """The same loss through materialised logits (hidden @ weight.T + bias) in ``dtype``."""
    inputs = [
        x.detach().to(dtype).requires_grad_() for x in (case["hidden"], case["weight"], case["bias"]) if x is not None
    ]
    logits = inputs[0] @ inputs[1].T + (inputs[2] if len(inputs) == 3 else 0)
    out = loss_fn(logits, *batch_args(case), **options)
    return out, torch.autograd.grad(out.loss, inputs)


def assert_matches(out, grads, expected, expected_grads, tol):
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert rel_err(out.loss, expected.loss) < tol
    for name, got, want in zip(("hidden", "weight", "bias"), grads, expected_grads):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < tol and max_err(got, want) < tol, name
    assert_metrics_match(out, expected, tol)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_reference(loss_type, importance_sampling, bias):
    case = make_linear_case(bias=bias)
    options = dict(
        loss_type=loss_type,
        importance_sampling=importance_sampling,
        max_completion_length=8,
        eps_high=1.2 if loss_type == "cispo" else 0.28,
        beta=0.04,
        chunk_size=4,
    )
    out, grads = run_fused(case, **options)
    del options["chunk_size"]
    expected, expected_grads = run_materialised(case, reference.grpo_loss, torch.float64, **options)
    assert_matches(out, grads, expected, expected_grads, 1e-5)
    if importance_sampling == "token" and loss_type != "sapo":
        assert out.clip_ratio_high > 0  # the case really clips


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, beta=0.1, kl_estimator="k1"),
        dict(beta=0.1, kl_estimator="k2"),
        dict(delta=1.5, dual_clip=3.0),
        dict(loss_type="dapo", num_items_in_batch=40),
        dict(return_entropy=True, temperature=0.9),
        dict(importance_weights="per_token"),
        dict(beta=0.1, kl_bias_correction=True),
        dict(loss_type="cispo", eps_high=3.0, beta=0.1, kl_bias_correction=True, importance_sampling="sequence"),
    ],
    ids=[
        "temp0.7",
        "temp1.3_k1",
        "k2",
        "delta_dual_clip",
        "dapo_num_items",
        "entropy",
        "importance_weights",
        "kl_bias",
        "cispo_seq_kl_bias",
    ],
)
@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_options_and_chunks(options, chunk_size):
    case = make_linear_case(seed=1)
    case["advantages"] = torch.randn(3, 5)  # per-token advantages
    if options.get("importance_weights") == "per_token":
        options = dict(options, importance_weights=torch.rand(3, 5) + 0.5)
    out, grads = run_fused(case, chunk_size=chunk_size, **options)
    expected, expected_grads = run_materialised(case, reference.grpo_loss, torch.float64, **options)
    assert_matches(out, grads, expected, expected_grads, 1e-5)
    # the op on materialised float32 logits gives the same numbers
    expected, expected_grads = run_materialised(case, grpo_fast.grpo_loss, torch.float32, **options)
    assert_matches(out, grads, expected, expected_grads, 1e-5)


def test_on_policy_and_empty_mask_row():
    case = make_linear_case()
    case["old_logprobs"] = None
    case["mask"][0] = 0
    out, grads = run_fused(case, chunk_size=4, beta=0.04)
    expected, expected_grads = run_materialised(case, reference.grpo_loss, torch.float64, beta=0.04)
    assert_matches(out, grads, expected, expected_grads, 1e-5)
    assert out.ratio_mean == 1
    assert grads[0][0].abs().max() == 0  # no gradient from a fully masked row


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_all_masked_batch_is_zero_not_nan(loss_type):
    """Every completion masked: loss 0 and zero gradients (the normaliser counts as 1)."""
    case = make_linear_case()
    case["mask"].zero_()
    out, grads = run_fused(case, chunk_size=4, beta=0.04, loss_type=loss_type, num_items_in_batch=0)
    assert out.loss.item() == 0.0 and all(g.abs().max().item() == 0.0 for g in grads)


@pytest.mark.parametrize("fp32_weight_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, fp32_weight_grad):
    # Logits of unit scale: the 16-bit rounding of the logits themselves, which every
    # implementation that multiplies in 16 bits shares, then stays well under the tolerance.
    case = make_linear_case(H=32, V=53, dtype=dtype, logit_scale=1.0)
    out, grads = run_fused(case, chunk_size=4, beta=0.04, fp32_weight_grad=fp32_weight_grad)
    assert [g.dtype for g in grads] == [dtype] * 3
    # the reference on the same 16-bit inputs, upcast
    expected, expected_grads = run_materialised(case, reference.grpo_loss, torch.float64, beta=0.04)
    assert_matches(out, grads, expected, expected_grads, 1e-2)
    # and no worse than eager 16-bit logits (materialised, then the reference loss)
    _, eager_grads = run_materialised(case, reference.grpo_loss, dtype, beta=0.04)
    for got, eager, want in zip(grads, eager_grads, expected_grads):
        assert rel_err(got, want) <= 1.5 * rel_err(eager, want) + 1e-3


def test_float64_is_exact():
    case = make_linear_case(dtype=torch.float64)
    out, grads = run_fused(case, chunk_size=4, beta=0.04, importance_sampling="sequence")
    expected, expected_grads = run_materialised(
        case, reference.grpo_loss, torch.float64, beta=0.04, importance_sampling="sequence"
    )
    assert_matches(out, grads, expected, expected_grads, 1e-12)


def test_frozen_weight_and_hidden_only():
    case = make_linear_case()
    hidden = case["hidden"].clone().requires_grad_()
    weight, bias = case["weight"], case["bias"]
    out = grpo_fast.fused_linear_grpo_loss(hidden, weight, *batch_args(case), bias=bias, chunk_size=4, beta=0.04)
    out.loss.backward()
    assert weight.grad is None and bias.grad is None
    _, expected_grads = run_materialised(case, reference.grpo_loss, torch.float64, beta=0.04)
    assert rel_err(hidden.grad, expected_grads[0]) < 1e-5 and max_err(hidden.grad, expected_grads[0]) < 1e-5
    # a frozen weight needs no [V, H] buffer
    assert fused_module._grad_buffers(hidden.view(15, -1), weight, bias, (True, False, False), True)[1] is None


def test_tied_embeddings():
    """hidden = f(E[input_ids]) and the LM head is E itself: E gets both gradients."""
    B, T, H, V = 2, 6, 16, 41
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(V, H, generator=g, dtype=torch.float64)
    mix = torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5
    input_ids, ids = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -0.7])

    def grads(loss_fn, dtype):
        e = emb.to(dtype).requires_grad_()
        hidden = torch.tanh(e[input_ids] @ mix.to(dtype))
        out = loss_fn(hidden, e)
        out.loss.backward()
        return e.grad

    fused = grads(lambda h, e: grpo_fast.fused_linear_grpo_loss(h, e, ids, adv, chunk_size=5), torch.float32)
    expected = grads(lambda h, e: reference.grpo_loss(h @ e.T, ids, adv), torch.float64)
    assert rel_err(fused, expected) < 1e-5 and max_err(fused, expected) < 1e-5


def test_backward_scales_and_runs_once():
    case = make_linear_case()
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    out = grpo_fast.fused_linear_grpo_loss(hidden, weight, *batch_args(case), chunk_size=4)
    (out.loss * -2.5).backward(retain_graph=True)
    _, expected_grads = run_materialised(dict(case, bias=None), reference.grpo_loss, torch.float64)
    assert (
        rel_err(hidden.grad, -2.5 * expected_grads[0]) < 1e-5 and max_err(hidden.grad, -2.5 * expected_grads[0]) < 1e-5
    )
    assert (
        rel_err(weight.grad, -2.5 * expected_grads[1]) < 1e-5 and max_err(weight.grad, -2.5 * expected_grads[1]) < 1e-5
    )
    with pytest.raises(RuntimeError, match="once"):
        out.loss.backward()


def test_no_grad_computes_no_gradients(monkeypatch):
    case = make_linear_case()
    calls = []
    monkeypatch.setattr(fused_module, "_chunk_backward", lambda *args: calls.append(args))
    hidden = case["hidden"].clone().requires_grad_()
    with torch.no_grad():
        out = grpo_fast.fused_linear_grpo_loss(
            hidden, case["weight"], *batch_args(case), bias=case["bias"], chunk_size=4
        )
    expected, _ = run_materialised(case, reference.grpo_loss, torch.float64)
    assert not calls and not out.loss.requires_grad
    assert rel_err(out.loss, expected.loss) < 1e-5


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_logits_never_exceed_a_chunk(monkeypatch, importance_sampling):
    """The memory bound: no logits buffer is ever taller than the chunk; and padding costs
    nothing: only the active tokens are swept."""
    case = make_linear_case(B=4, T=9)
    heights = []
    chunk_logits = fused_module._chunk_logits

    def recording(h, weight, bias):
        heights.append(h.shape[0])
        return chunk_logits(h, weight, bias)

    monkeypatch.setattr(fused_module, "_chunk_logits", recording)
    run_fused(case, chunk_size=5, importance_sampling=importance_sampling)
    active = int(case["mask"].sum())
    assert active < 36 and max(heights) == 5
    assert sum(heights) == active * (1 if importance_sampling == "token" else 2)


def test_default_chunks_are_bounded_and_even():
    N = 100_000
    rows = fused_module._chunk_rows(N, 151_936, 4, torch.device("cpu"), None)
    assert rows * 151_936 * 4 <= fused_module.LOGITS_CHUNK_BYTES["cpu"]
    n_chunks = -(-N // rows)
    assert n_chunks * rows - N < n_chunks  # near-equal chunks: the last is at most n_chunks - 1 rows short
    assert fused_module._chunk_rows(10, 151_936, 4, torch.device("cpu"), None) == 10
    assert fused_module._chunk_rows(10, 151_936, 4, torch.device("cpu"), 3) == 3
    assert fused_module._chunk_rows(0, 151_936, 4, torch.device("cpu"), None) == 1


@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs(return_entropy):
    case = make_linear_case()
    h, w, b = case["hidden"], case["weight"], case["bias"]
    out = grpo_fast.fused_linear_token_logprobs(
        h.requires_grad_(), w, case["ids"], bias=b, temperature=0.8, return_entropy=return_entropy, chunk_size=4
    )
    expected = reference.token_logprobs(
        (h @ w.T + b).double(), case["ids"], temperature=0.8, return_entropy=return_entropy
    )
    if not return_entropy:
        out, expected = (out,), (expected,)
    for got, want in zip(out, expected):
        assert got.shape == (3, 5) and got.dtype == torch.float32
        assert rel_err(got, want) < 1e-5
    assert (out[0] <= 0).all()
    assert out[0].requires_grad and all(not entropy.requires_grad for entropy in out[1:])  # log-probs only


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_other_backends(monkeypatch, backend):
    pytest.importorskip("triton")
    monkeypatch.setenv("GRPO_FAST_BACKEND", backend)
    case = make_linear_case(V=37)
    options = dict(beta=0.04, temperature=0.9, return_entropy=True)
    out, grads = run_fused(case, chunk_size=7, **options)
    expected, expected_grads = run_materialised(case, reference.grpo_loss, torch.float64, **options)
    assert_matches(out, grads, expected, expected_grads, 1e-5)
    logp = grpo_fast.fused_linear_token_logprobs(case["hidden"], case["weight"], case["ids"], bias=case["bias"])
    logits = case["hidden"].double() @ case["weight"].double().T + case["bias"].double()
    assert rel_err(logp, reference.token_logprobs(logits, case["ids"])) < 1e-5


def test_bad_input():
    case = make_linear_case()
    h, w, b, ids, adv = case["hidden"], case["weight"], case["bias"], case["ids"], case["advantages"]
    fn = grpo_fast.fused_linear_grpo_loss
    with pytest.raises(ValueError, match=r"hidden must have 3 dimensions"):
        fn(h[0], w, ids, adv)
    with pytest.raises(ValueError, match=r"weight must have shape \[V, H\] with H = .* 16"):
        fn(h, w[:, :15], ids, adv)
    with pytest.raises(ValueError, match=r"bias must have shape \[V\] = \[37\]"):
        fn(h, w, ids, adv, bias=b[:36])
    with pytest.raises(TypeError, match=r"weight must have the dtype of hidden"):
        fn(h, w.double(), ids, adv)
    with pytest.raises(TypeError, match=r"bias must have the dtype of hidden"):
        fn(h, w, ids, adv, bias=b.double())
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V\) = \[0, 37\)"):
        fn(h, w, ids + 30, adv)
    with pytest.raises(ValueError, match=r"ids must have shape \[3, 5\]"):
        fn(h, w, ids[:, :4], adv)
    with pytest.raises(TypeError, match=r"ids must be an integer tensor"):
        fn(h, w, ids.float(), adv)
    with pytest.raises(ValueError, match=r"advantages must have shape \[3, 5\] or \[3\]"):
        fn(h, w, ids, adv[:2])
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int"):
        fn(h, w, ids, adv, chunk_size=0)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0"):
        grpo_fast.fused_linear_token_logprobs(h, w, ids, temperature=0.0)
    with pytest.raises(ValueError, match=r"ref_logprobs \[B, T\] is required"):
        fn(h, w, ids, adv, beta=0.1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["grid", "flat"])
def test_token_logprobs_gradients(monkeypatch, backend, layout):
    """dL/d(hidden, weight, bias) of sum(g * logp) against the reference on materialised logits
    in float64; chunks of 4 over 15 tokens leave a remainder, one token's g is 0."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("GRPO_FAST_BACKEND", backend)
    case = make_linear_case()
    g = torch.randn(3, 5, generator=torch.Generator().manual_seed(7))
    g[1, 2] = 0.0
    inputs = [case[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    h, ids = inputs[0], case["ids"]
    if layout == "flat":
        h, ids, g = h.reshape(15, -1), ids.reshape(15), g.reshape(15)
    logp = grpo_fast.fused_linear_token_logprobs(h, inputs[1], ids, bias=inputs[2], temperature=0.8, chunk_size=4)
    grads = torch.autograd.grad((logp * g).sum(), inputs)
    truth = [case[k].double().requires_grad_() for k in ("hidden", "weight", "bias")]
    want = reference.token_logprobs(truth[0] @ truth[1].T + truth[2], case["ids"], temperature=0.8)
    want_grads = torch.autograd.grad((want * g.view(3, 5).double()).sum(), truth)
    assert logp.shape == ids.shape and rel_err(logp.reshape(3, 5), want) < 1e-5
    for name, got, expected in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert got.shape == expected.shape and got.dtype == torch.float32, name
        assert rel_err(got, expected) < 1e-5, name
        assert (got.double() - expected).abs().max() < 1e-5 * expected.abs().max(), name  # element-wise too


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("op", ["fused_linear_grpo_loss", "policy_loss"])
def test_flat_rows_equal_the_grid(op, importance_sampling):
    """The packed layout: the grid's active tokens as flat rows [Na] with their sequence
    boundaries (an empty sequence included), advantages per sequence [n, 1], give the grid's
    loss, metrics and gradients."""
    case = make_linear_case(B=4)
    case["mask"][2] = 0  # an empty sequence: it still counts as a row of the grpo mean
    options = dict(beta=0.04, importance_sampling=importance_sampling, return_entropy=True)
    mask = case["mask"].bool()
    lengths = mask.sum(1)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    ids, adv, old, ref = case["ids"], case["advantages"], case["old_logprobs"], case["ref_logprobs"]

    def loss(flat):
        h, i = (hidden[mask], ids[mask]) if flat else (hidden, ids)
        m, o, r = (x[mask] if flat else x for x in (case["mask"], old, ref))
        a = adv.unsqueeze(1) if flat else adv
        keywords = dict(options, cu_seqlens=cu_seqlens) if flat else dict(options)
        if op == "policy_loss":
            logits = (h @ weight.T + case["bias"]).view(-1, i.shape[-1], weight.shape[0])  # [B, T, V] or [1, Na, V]
            logp, entropy = grpo_fast.token_logprobs(logits, i.view(logits.shape[:2]), return_entropy=True)
            keywords.pop("return_entropy")
            logp, entropy = (logp[0], entropy[0]) if flat else (logp, entropy)
            return grpo_fast.policy_loss(logp, a, m, o, r, entropy=entropy, **keywords)
        return grpo_fast.fused_linear_grpo_loss(h, weight, i, a, m, o, r, bias=case["bias"], chunk_size=3, **keywords)

    outs, grads = [], []
    for flat in (False, True):
        out = loss(flat)
        outs.append(out)
        grads.append(torch.autograd.grad(out.loss, (hidden, weight)))
    assert rel_err(outs[1].loss, outs[0].loss) < 1e-6
    for name in METRICS:
        assert abs(getattr(outs[1], name).item() - getattr(outs[0], name).item()) < 1e-6, name
    for got, want in zip(grads[1], grads[0]):
        assert want.abs().max() > 0 and rel_err(got, want) < 1e-6


def test_flat_rows_bad_input():
    case = make_linear_case()
    h, w, ids = case["hidden"].reshape(15, -1), case["weight"], case["ids"].reshape(15)
    adv = torch.randn(15)
    fn = grpo_fast.fused_linear_grpo_loss
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, end at the token count 15"):
        fn(h, w, ids, adv, cu_seqlens=torch.tensor([0, 4, 14]))
    with pytest.raises(ValueError, match=r"advantages must have shape \[15\] or \[2, 1\]"):
        fn(h, w, ids, torch.randn(2), cu_seqlens=torch.tensor([0, 4, 15]))
    with pytest.raises(ValueError, match=r"hidden must have 2 dimensions"):
        fn(h.unsqueeze(0), w, ids, adv, cu_seqlens=torch.tensor([0, 4, 15]))
    with pytest.raises(TypeError, match=r"cu_seqlens must be an integer tensor"):
        fn(h, w, ids, adv, cu_seqlens=torch.tensor([0.0, 15.0]))
