"""Triton kernels against the float64 reference: the cases that are specific to the kernels.

The public-op parity matrix (loss types x importance levels x regimes x KL x masks x
temperature x strides x odd sizes x bf16/fp16/fp64) runs on the Triton backend through the
``backend`` parametrization of ``test_ops.py``. Here the vocabulary block is lowered to 16
so that tiny vocabularies span several blocks, and the kernels are driven where they can
go wrong: block boundaries (V = BLOCK - 1, BLOCK, BLOCK + 1), blocks that are all -inf
(padded vocabulary), masked rows (never read: NaN logits there must not leak), T = 1,
in-place gradients, the backward rescale, and group tiles that do not divide the groups.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest); ``GRPO_FAST_TEST_CUDA=1`` runs
the same tests on CUDA tensors with compiled kernels.
"""

import os

import pytest
import torch
from conftest import assert_metrics_match, max_err, rel_err

import grpo_fast
import grpo_fast.kernels.group_advantages
import grpo_fast.kernels.grpo_loss
import grpo_fast.kernels.token_logprobs as triton_logprobs
from grpo_fast import reference
from grpo_fast.kernels.group_advantages import group_advantages_triton
from grpo_fast.spec import LOSS_TYPES

BLOCK = 16
DEVICE = "cuda" if os.environ.get("GRPO_FAST_TEST_CUDA") == "1" and torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_small_blocks(monkeypatch):
    monkeypatch.setenv("GRPO_FAST_BACKEND", "triton")
    monkeypatch.setattr(triton_logprobs, "MAX_BLOCK_V", BLOCK)
    monkeypatch.setattr(triton_logprobs, "MAX_STRIDED_BLOCK_V", BLOCK // 2)


def test_transposed_logits_take_the_strided_block():
    """Logits read along a non-unit vocabulary stride (a transposed view) take the smaller
    block, and give the reference's loss and gradient."""
    batch = make_batch(3, 4, 3 * BLOCK + 1, seed=11)
    batch["logits"] = batch["logits"].transpose(0, 2).contiguous().transpose(0, 2)  # stride_v = B * T
    assert batch["logits"].stride(2) == 12
    assert triton_logprobs.block_size(3 * BLOCK + 1, None, 12) == BLOCK // 2
    assert triton_logprobs.block_size(3 * BLOCK + 1, None, 1) == BLOCK
    assert_matches_reference(batch, 1e-5, beta=0.04, return_entropy=True)


def make_batch(B, T, V, *, dtype=torch.float32, strided=False, temperature=1.0, seed=0):
    """Logits (a strided slice when asked), ids, and old/ref log-probs whose ratios cross both
    clip bounds; advantages of both signs; the last row half masked, row 1 fully masked."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(B, T + 1, V, generator=g, dtype=torch.float64) * 2
    logits = (full[:, 1:] if strided else full[:, :T].contiguous()).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    logp = reference.token_logprobs(logits.double(), ids, temperature=temperature)
    old = logp - torch.tensor([-0.6, 0.7, -0.1, 0.4, 0.05], dtype=torch.float64).repeat(T)[:T]
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g)
    adv[0], adv[-1] = abs(adv[0]) + 1.0, -0.3  # both signs, and a loss far from 0 (no cancellation)
    mask = torch.ones(B, T)
    mask[-1, T // 2 :] = 0
    if B > 2:
        mask[1] = 0
    return dict(logits=logits, ids=ids, advantages=adv, mask=mask, old_logprobs=old.float(), ref_logprobs=ref.float())


def to_device(batch):
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def loss_and_grad(fn, batch, dtype=None, **options):
    logits = batch["logits"].detach()
    logits = (logits if dtype is None else logits.to(dtype)).requires_grad_()
    keys = ("ids", "advantages", "mask", "old_logprobs", "ref_logprobs")
    out = fn(logits, *(batch[k] for k in keys), **options)
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out, grad


def assert_matches_reference(batch, tol, **options):
    out, grad = loss_and_grad(grpo_fast.grpo_loss, to_device(batch), **options)
    want, want_grad = loss_and_grad(reference.grpo_loss, batch, torch.float64, **options)
    assert grad.dtype == batch["logits"].dtype and torch.isfinite(grad).all()
    assert rel_err(out.loss.cpu(), want.loss) < tol
    assert rel_err(grad.cpu(), want_grad) < tol and max_err(grad.cpu(), want_grad) < tol
    assert_metrics_match(out, want, tol)
    return out, grad


# ----------------------------------------------------------------------------- token log-probs


@pytest.mark.parametrize("V", [BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_logprobs_block_boundaries(V, strided):
    batch = make_batch(2, 3, V, strided=strided)
    logits = batch["logits"].to(DEVICE).requires_grad_()
    logp, entropy = grpo_fast.token_logprobs(logits, batch["ids"].to(DEVICE), temperature=0.7, return_entropy=True)
    ref_logits = batch["logits"].double().requires_grad_()
    ref_logp, ref_entropy = reference.token_logprobs(ref_logits, batch["ids"], temperature=0.7, return_entropy=True)
    assert rel_err(logp.cpu(), ref_logp) < 1e-6 and rel_err(entropy.cpu(), ref_entropy) < 1e-6
    assert (logp <= 0).all()
    weights = torch.randn(2, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((logp * weights.to(DEVICE)).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_logp * weights).sum(), ref_logits)
    assert rel_err(grad.cpu(), ref_grad) < 1e-6 and max_err(grad.cpu(), ref_grad) < 1e-6


def test_logprobs_inplace_backward_writes_into_strided_logits():
    batch = make_batch(2, 4, BLOCK + 3, strided=True)
    logits = batch["logits"].to(DEVICE)
    storage = logits.detach()
    ref_logits = batch["logits"].double().requires_grad_()
    weights = torch.randn(2, 4)
    ref_logp = reference.token_logprobs(ref_logits, batch["ids"], temperature=1.3)
    (ref_grad,) = torch.autograd.grad((ref_logp * weights.double()).sum(), ref_logits)
    leaf = logits.requires_grad_()
    logp = grpo_fast.token_logprobs(leaf, batch["ids"].to(DEVICE), temperature=1.3, inplace_backward=True)
    (grad,) = torch.autograd.grad((logp * weights.to(DEVICE)).sum(), leaf)
    assert grad.data_ptr() == storage.data_ptr()
    assert rel_err(storage.cpu(), ref_grad) < 1e-6 and max_err(storage.cpu(), ref_grad) < 1e-6


def test_logprobs_padded_vocabulary():
    """-inf logits, including a whole leading block (the running max starts at -inf) and a
    whole trailing one: same log-probs, entropy and gradient as on the unpadded vocabulary."""
    V, real = 4 * BLOCK, slice(BLOCK + 2, 3 * BLOCK - 1)
    batch = make_batch(2, 3, V)
    logits = torch.full((2, 3, V), float("-inf"))
    logits[..., real] = batch["logits"][..., real]
    ids = torch.randint(real.start, real.stop, (2, 3))
    leaf = logits.to(DEVICE).requires_grad_()
    logp, entropy = grpo_fast.token_logprobs(leaf, ids.to(DEVICE), return_entropy=True)
    (grad,) = torch.autograd.grad(logp.sum(), leaf)
    ref_logits = logits[..., real].double().requires_grad_()
    ref_logp, ref_entropy = reference.token_logprobs(ref_logits, ids - real.start, return_entropy=True)
    (ref_grad,) = torch.autograd.grad(ref_logp.sum(), ref_logits)
    assert rel_err(logp.cpu(), ref_logp) < 1e-6 and rel_err(entropy.cpu(), ref_entropy) < 1e-6
    assert rel_err(grad[..., real].cpu(), ref_grad) < 1e-6 and max_err(grad[..., real].cpu(), ref_grad) < 1e-6
    assert grad[..., : real.start].abs().max() == 0 and grad[..., real.stop :].abs().max() == 0


def test_logprobs_explicit_block_launcher_args():
    """The launchers' block_v argument, with a block larger than V (a single masked block)."""
    batch = make_batch(2, 2, 2 * BLOCK + 1, dtype=torch.bfloat16)
    logits, ids = batch["logits"].to(DEVICE), batch["ids"].to(DEVICE)
    ref = reference.token_logprobs(batch["logits"].double(), batch["ids"])
    for block_v in (8, 64):
        logp, lse, entropy = triton_logprobs.logprobs_fwd(logits, ids, 1.0, False, block_v=block_v)
        assert entropy is None and logp.dtype == torch.float32 and rel_err(logp.cpu(), ref) < 1e-6
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        triton_logprobs.logprobs_fwd(logits, ids, 1.0, False, block_v=24)


# ----------------------------------------------------------------------------- fused loss


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_fused_loss_across_blocks(loss_type, importance_sampling):
    """Every loss type, clipped both ways, k3 KL, temperature, strided logits, an empty row,
    with V spanning three blocks."""
    batch = make_batch(3, 5, 2 * BLOCK + 5, strided=True, temperature=0.7, seed=1)
    options = dict(
        loss_type=loss_type,
        importance_sampling=importance_sampling,
        max_completion_length=7,
        beta=0.04,
        temperature=0.7,
        eps_high=1.2 if loss_type == "cispo" else 0.28,
    )
    out, _ = assert_matches_reference(batch, 1e-5, **options)
    if importance_sampling == "token" and loss_type not in ("sapo", "cispo"):
        assert out.clip_ratio_low > 0 and out.clip_ratio_high > 0  # both clip bounds crossed


@pytest.mark.parametrize(
    "options",
    [
        dict(dual_clip=2.0, delta=1.6, kl_estimator="k1", beta=0.1),
        dict(loss_type="dapo", num_items_in_batch=torch.tensor(11.0), kl_estimator="k2", beta=0.2),
        dict(loss_type="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5, return_entropy=True),
        dict(old=None, beta=0.04, return_entropy=True),
        dict(beta=0.1, kl_bias_correction=True, kl_estimator="k1"),
        dict(old=None, beta=0.1, kl_bias_correction=True),
    ],
    ids=["dual_delta_k1", "dapo_items_k2", "sapo_entropy", "on_policy", "kl_bias_k1", "kl_bias_on_policy"],
)
def test_fused_loss_options(options):
    batch = make_batch(3, 4, BLOCK + 1, seed=2)
    if options.pop("old", True) is None:
        batch["old_logprobs"] = None
    batch["advantages"] = torch.randn(3, 4)  # per-token advantages
    assert_matches_reference(batch, 1e-5, importance_weights=torch.rand(3, 4) + 0.5, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_loss_low_precision(dtype):
    batch = make_batch(3, 4, 3 * BLOCK - 1, dtype=dtype, strided=True, temperature=0.9, seed=3)
    _, grad = assert_matches_reference(batch, 1e-2, beta=0.04, temperature=0.9, return_entropy=True)
    assert grad.dtype == dtype


@pytest.mark.parametrize("V", [BLOCK - 1, BLOCK, BLOCK + 1])
def test_fused_loss_single_token_rows(V):
    batch = make_batch(3, 1, V, seed=4)
    batch["mask"][0] = 1  # rows: active, empty, active
    assert_matches_reference(batch, 1e-5, beta=0.04, return_entropy=True)


def test_fused_loss_launch_knobs():
    """Fewer programs than rows (each loops over rows), other warps and blocks: same numbers."""
    batch = make_batch(3, 5, 2 * BLOCK + 3, strided=True, seed=10)
    want, want_grad = loss_and_grad(reference.grpo_loss, batch, torch.float64, beta=0.04, return_entropy=True)
    for knobs in (dict(programs=4), dict(programs=1, warps=2, block_v=32)):
        out, grad = loss_and_grad(grpo_fast.grpo_loss, to_device(batch), beta=0.04, return_entropy=True, launch=knobs)
        assert (
            rel_err(out.loss.cpu(), want.loss) < 1e-5
            and rel_err(grad.cpu(), want_grad) < 1e-5
            and max_err(grad.cpu(), want_grad) < 1e-5
        )
        assert rel_err(out.entropy.cpu(), want.entropy) < 1e-5


def test_masked_rows_are_never_read():
    """Padding rows hold NaN logits: the loss, the metrics and the other rows' gradient are
    those of the reference on the clean logits, and the padding gradient is exactly 0."""
    batch = make_batch(3, 4, BLOCK + 5, seed=5)
    clean = make_batch(3, 4, BLOCK + 5, seed=5)
    masked = batch["mask"] == 0
    batch["logits"][masked] = float("nan")
    out, grad = loss_and_grad(grpo_fast.grpo_loss, to_device(batch), beta=0.04, return_entropy=True)
    want, want_grad = loss_and_grad(reference.grpo_loss, clean, torch.float64, beta=0.04, return_entropy=True)
    assert rel_err(out.loss.cpu(), want.loss) < 1e-5 and rel_err(out.kl.cpu(), want.kl) < 1e-5
    assert rel_err(out.entropy.cpu(), want.entropy) < 1e-5
    assert grad[masked.to(DEVICE)].abs().max() == 0
    assert rel_err(grad.cpu(), want_grad) < 1e-5 and max_err(grad.cpu(), want_grad) < 1e-5


def test_fully_masked_batch_gives_zero_gradient():
    batch = make_batch(2, 3, BLOCK - 1, seed=6)
    batch["mask"].zero_()
    out, grad = loss_and_grad(grpo_fast.grpo_loss, to_device(batch), beta=0.04)
    assert out.loss.item() == 0 and grad.abs().max() == 0


@pytest.mark.parametrize("inplace", [False, True], ids=["new_buffer", "inplace"])
def test_backward_rescales_by_incoming_gradient(inplace):
    """Backward multiplies the forward's gradient by dOut/dloss on the device; 1 leaves it."""
    batch = to_device(make_batch(2, 3, BLOCK + 3, seed=7))
    keys = ("ids", "advantages", "mask", "old_logprobs", "ref_logprobs")
    grads = []
    for scale in (1.0, -0.25):
        logits = batch["logits"].clone().requires_grad_()
        out = grpo_fast.grpo_loss(logits, *(batch[k] for k in keys), beta=0.04, inplace_backward=inplace)
        (out.loss * scale).backward()
        grads.append(logits.detach().clone() if inplace else logits.grad)
    assert rel_err(grads[1], -0.25 * grads[0]) < 1e-6 and max_err(grads[1], -0.25 * grads[0]) < 1e-6


def test_no_grad_forward_leaves_logits_untouched():
    """Under no_grad the fused loss only sweeps once and writes no gradient, even in place."""
    batch = to_device(make_batch(3, 4, BLOCK + 2, seed=8))
    logits = batch["logits"].clone().requires_grad_()
    keys = ("ids", "advantages", "mask", "old_logprobs", "ref_logprobs")
    with torch.no_grad():
        out = grpo_fast.grpo_loss(logits, *(batch[k] for k in keys), beta=0.04, inplace_backward=True)
    assert torch.equal(logits.detach(), batch["logits"])
    want = reference.grpo_loss(batch["logits"].double().cpu(), *(batch[k].cpu() for k in keys), beta=0.04)
    assert rel_err(out.loss.cpu(), want.loss) < 1e-5 and rel_err(out.kl.cpu(), want.kl) < 1e-5


# ----------------------------------------------------------------------------- group advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("layout", ["flat", "groups", "columns"])
def test_group_advantages_tiles(scale, layout):
    """5 groups of G = 3 in tiles of 2 groups (the last tile half empty), one group with
    equal rewards, NaN (unscored) entries in the weighted columns."""
    g = torch.Generator().manual_seed(9)
    G, num_groups = 3, 5
    rewards = torch.randn(num_groups * G, 2, generator=g)
    rewards[3:6] = torch.tensor([1.0, 0.5])
    rewards[7, 1] = float("nan")
    weights = torch.tensor([1.0, 0.5])
    if layout == "flat":
        args, kwargs = (rewards[:, 0], G), {}
    elif layout == "groups":
        args, kwargs = (rewards[:, 0].reshape(num_groups, G), None), {}
    else:
        args, kwargs = (rewards, G), dict(reward_weights=weights)
    want = reference.group_advantages(*args, scale=scale, **kwargs)
    flat = args[0].reshape(-1) if layout == "groups" else args[0]
    got = group_advantages_triton(
        flat.to(DEVICE),
        G,
        scale=scale,
        block_groups=2,
        reward_weights=None if layout != "columns" else weights.to(DEVICE),
    )
    public = grpo_fast.group_advantages(
        args[0].to(DEVICE), args[1], scale=scale, **({k: v.to(DEVICE) for k, v in kwargs.items()})
    )
    for out in (got, public):
        for name, a, b in zip(want._fields, out, want):
            assert a.shape == b.shape and a.dtype == torch.float32, name
            assert rel_err(a.cpu(), b) < 1e-6, name
        assert out.advantages[3:6].abs().max() == 0  # equal rewards: exactly 0
        assert out.frac_zero_std.item() == pytest.approx(1 / num_groups)


def test_every_launch_runs_under_the_device_guard(monkeypatch):
    """Each launcher (log-probs forward and backward, the one-launch loss and its gradient
    scaling, group advantages) enters ``torch.cuda.device`` with its tensors' device before the
    kernel runs: on CUDA the launch goes to that device, not the current one. Under the
    interpreter the guard is entered with -1 (no switch); the kernels still compute."""
    real_device = torch.cuda.device
    entered, launched = [], []

    class Recording(real_device):
        def __enter__(self):
            entered.append(self.idx)
            return super().__enter__()

    monkeypatch.setattr(torch.cuda, "device", Recording)
    for module, kernel in (
        (triton_logprobs, "_logprobs_fwd_kernel"),
        (triton_logprobs, "_logprobs_bwd_kernel"),
        (grpo_fast.kernels.grpo_loss, "_grpo_loss_fwd_kernel"),
        (grpo_fast.kernels.grpo_loss, "_scale_grad_kernel"),
        (grpo_fast.kernels.group_advantages, "_group_advantages_kernel"),
    ):
        original = getattr(module, kernel)

        class Launch:  # kernel[grid](...): records that the guard was entered first
            def __init__(self, name, jit):
                self.name, self.jit = name, jit

            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launched.append((self.name, len(entered)))
                    return self.jit[grid](*args, **kwargs)

                return run

        monkeypatch.setattr(module, kernel, Launch(kernel, original))
    batch = to_device(make_batch(2, 3, BLOCK + 1, seed=5))
    idx = batch["logits"].device.index if DEVICE == "cuda" else -1
    loss_and_grad(grpo_fast.grpo_loss, batch, beta=0.04)  # one launch + scaled gradient
    loss_and_grad(grpo_fast.grpo_loss, batch, importance_sampling="sequence")  # log-probs forward + backward
    grpo_fast.group_advantages(torch.randn(8, device=DEVICE), group_size=4)
    names = [name for name, _ in launched]
    assert set(names) == {
        "_logprobs_fwd_kernel",
        "_logprobs_bwd_kernel",
        "_grpo_loss_fwd_kernel",
        "_scale_grad_kernel",
        "_group_advantages_kernel",
    }
    assert [count for _, count in launched] == list(range(1, len(launched) + 1))  # one guard entered per launch
    assert entered == [idx] * len(launched)
