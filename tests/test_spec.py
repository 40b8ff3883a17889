"""The loss spec: LossConfig validation and freezing, and a loss type added through the
spec's table alone reaching the reference, every backend, the fused LM head and the trainer."""

import argparse
import dataclasses
import inspect

import pytest
import torch
from _steps import next_batch, repacked
from conftest import BACKENDS, batch_args, make_case, max_err, rel_err, trl_sampling_correction

import grpo_fast
from grpo_fast import LossConfig, reference, spec
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer


def test_loss_config_is_frozen_validated_and_hashable():
    config = LossConfig(beta=0.04, loss_type="dapo", eps_high=0.28)
    with pytest.raises(dataclasses.FrozenInstanceError, match="use dataclasses.replace"):
        config.beta = 0.1
    assert dataclasses.replace(config, beta=0.1).beta == 0.1 and config.beta == 0.04
    assert config == LossConfig(beta=0.04, loss_type="dapo", eps_high=0.28) and hash(config) == hash(
        LossConfig(beta=0.04, loss_type="dapo", eps_high=0.28)
    )
    assert config.clip_high == 0.28 and LossConfig().clip_high == 0.2


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(loss_type="ppo"), "loss_type must be one of"),
        (dict(kl_estimator="k4"), "kl_estimator must be one of"),
        (dict(importance_sampling="seq"), "importance_sampling must be one of"),
        (dict(eps_low=1.0), "eps_low must be < 1"),
        (dict(delta=1.0), "delta must be a finite number > 1"),
        (dict(dual_clip=0.5), "dual_clip must be a finite number > 1"),
        (dict(beta=float("nan")), "beta must be a finite number >= 0"),
        (dict(beta=True), "beta must be a finite number"),
        (dict(temperature=0), "temperature must be a finite number > 0"),
        (dict(sapo_tau_neg=0.0), "sapo_tau_neg must be"),
        (dict(loss_type="dr_grpo"), "max_completion_length is required for loss_type='dr_grpo'"),
        (dict(max_completion_length=0), "max_completion_length must be a positive int"),
        (dict(kl_bias_correction=1), "kl_bias_correction must be a bool"),
    ],
)
def test_loss_config_rejects_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**options)


def test_cispo_may_have_eps_low_of_one():
    """CISPO does not clip from below: eps_low >= 1 is not an error there."""
    assert LossConfig(loss_type="cispo", eps_low=1.0, eps_high=5.0).eps_low == 1.0


def test_public_signatures_and_docs_come_from_the_spec():
    names = [f.name for f in dataclasses.fields(LossConfig)]
    for fn in (grpo_fast.grpo_loss, grpo_fast.fused_linear_grpo_loss, grpo_fast.policy_loss):
        params = inspect.signature(fn).parameters
        for f in dataclasses.fields(LossConfig):
            assert params[f.name].default == f.default and params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
            assert f.metadata["help"] in fn.__doc__, (fn.__name__, f.name)
        assert list(params)[-len(names) - 1 : -1] == names and list(params)[-1] == "loss_config"


def test_loss_config_object_equals_keywords_and_not_both(monkeypatch):
    monkeypatch.setenv("GRPO_FAST_BACKEND", "torch")
    case = make_case(regime="clipped", seed=3)
    args = (case["logits"], case["ids"], case["advantages"], case["mask"], case["old_logprobs"], case["ref_logprobs"])
    options = dict(beta=0.04, loss_type="bnpo", eps_high=0.28, kl_bias_correction=True)
    by_keywords = grpo_fast.grpo_loss(*args, **options)
    by_object = grpo_fast.grpo_loss(*args, loss_config=LossConfig(**options))
    assert torch.equal(by_keywords.loss, by_object.loss)
    with pytest.raises(TypeError, match="not both"):
        grpo_fast.grpo_loss(*args, beta=0.04, loss_config=LossConfig(beta=0.04))
    with pytest.raises(TypeError, match="loss_config must be a grpo_fast.LossConfig"):
        grpo_fast.grpo_loss(*args, loss_config=dict(beta=0.04))
    trainer_config = GRPOConfig(**options)  # the trainer's config holds a LossConfig: its loss section
    assert grpo_fast.grpo_loss(*args, loss_config=trainer_config.loss).loss.item() == by_keywords.loss.item()
    with pytest.raises(TypeError, match="loss_config must be a grpo_fast.LossConfig, got GRPOConfig"):
        grpo_fast.grpo_loss(*args, loss_config=trainer_config)


def test_trainer_config_rejects_loss_options_before_loading_anything():
    for options, match in (
        (dict(eps_low=1.5), "eps_low must be < 1"),
        (dict(delta=0.9), "delta must be"),
        (dict(dual_clip=1.0), "dual_clip must be"),
    ):
        with pytest.raises(ValueError, match=match):
            GRPOConfig(**options).validate()
    assert GRPOConfig(loss_type="dr_grpo", max_new_tokens=7).loss.max_completion_length == 7


# ----------------------------------------------------------------------------- a toy loss type


def toy_term(w, logp, adv, c):
    """Unclipped policy gradient with the ratio squared: -w^2 A (differentiable, no clipping)."""
    return -(w * w) * adv


@pytest.fixture
def toy_loss_type(monkeypatch):
    """A loss type added to the spec's table and nowhere else: per-token -w^2 A, aggregated
    as a token sum over the batch's tokens (bnpo's rule), without a Triton kernel branch."""
    row = spec.LossType(toy_term, spec.clipped_flags, "batch_tokens", kernel_kind=None, clipped=False)
    monkeypatch.setitem(spec.LOSS_TYPES, "toy", row)
    return "toy"


def by_hand(logp, old, adv, mask, ref, beta):
    """The toy loss written out: sum_bt m (-(exp(logp - old))^2 A + beta k3) / sum m."""
    w = torch.exp(logp - old)
    d = ref - logp
    per_token = -(w * w) * adv.unsqueeze(1) + beta * (torch.exp(d) - d - 1)
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_toy_loss_type_reaches_the_reference_and_every_backend(toy_loss_type, backend):
    case = make_case(regime="clipped", seed=5)
    logits64 = case["logits"].double().requires_grad_()
    ref_out = reference.grpo_loss(
        logits64,
        *batch_args(case),
        loss_type=toy_loss_type,
        beta=0.04,
    )
    logp = reference.token_logprobs(logits64, case["ids"])
    want = by_hand(
        logp, case["old_logprobs"], case["advantages"].double(), case["mask"].double(), case["ref_logprobs"], 0.04
    )
    assert ref_out.loss.item() == pytest.approx(want.item(), rel=1e-12)
    (ref_grad,) = torch.autograd.grad(ref_out.loss, logits64)

    logits = case["logits"].detach().requires_grad_()
    out = grpo_fast.grpo_loss(
        logits,
        *batch_args(case),
        loss_type=toy_loss_type,
        beta=0.04,
    )
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert rel_err(out.loss, ref_out.loss) < 1e-5 and rel_err(grad, ref_grad) < 1e-5 and max_err(grad, ref_grad) < 1e-5
    assert rel_err(out.ratio_mean, ref_out.ratio_mean) < 1e-6 and out.clip_ratio_region > 0

    # the fused LM head on the same loss type
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(case["logits"].shape[-1], 8, dtype=torch.float64, requires_grad=True)
    batch = (case["ids"], case["advantages"], case["mask"], case["old_logprobs"], case["ref_logprobs"])
    fused = grpo_fast.fused_linear_grpo_loss(hidden, weight, *batch, loss_type=toy_loss_type, beta=0.04, chunk_size=4)
    fused_grads = torch.autograd.grad(fused.loss, (hidden, weight))
    ref_fused = reference.grpo_loss(hidden @ weight.T, *batch, loss_type=toy_loss_type, beta=0.04)
    ref_grads = torch.autograd.grad(ref_fused.loss, (hidden, weight))
    assert rel_err(fused.loss, ref_fused.loss) < 1e-10
    assert all(rel_err(a, b) < 1e-10 and max_err(a, b) < 1e-10 for a, b in zip(fused_grads, ref_grads))


def test_toy_loss_type_reaches_the_trainers_micro_batch_weights(toy_loss_type, tmp_path):
    """Micro-batches of 3 rows (uneven token counts) accumulate the full batch's gradient:
    the trainer weighs each micro-batch's loss by the toy type's aggregation (token counts)."""
    tokenizer = build_tokenizer()
    config = GRPOConfig(
        loss_type=toy_loss_type,
        batch_size=12,
        group_size=4,
        max_new_tokens=3,
        beta=0.1,
        num_iterations=2,
        progress=False,
        output_dir=str(tmp_path),
    )
    trainer = GRPOTrainer(config, model=build_model(tokenizer), tokenizer=tokenizer)
    batch = next_batch(trainer)
    batch.advantages = torch.randn(12)  # a signal, whatever was sampled
    assert len(set(batch.completion_mask.sum(1).tolist())) > 1  # rows of different lengths
    grads = []
    for micro in (None, 3):
        trainer.config.micro_batch_size = micro
        trainer.accumulate_gradients(repacked(trainer, batch), None)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))
        trainer.optimizer.zero_grad(set_to_none=True)
    assert grads[0].norm() > 0 and rel_err(grads[1], grads[0]) < 1e-5 and max_err(grads[1], grads[0]) < 1e-5
    # a rows-count weighting would differ: the token-count rule is what made them equal
    rows = spec.AGGREGATIONS["sequence_mean"].micro_batch_weight(3, 5.0, 12, 20.0, trainer.loss_config)
    tokens = spec.AGGREGATIONS["batch_tokens"].micro_batch_weight(3, 5.0, 12, 20.0, trainer.loss_config)
    assert (
        rows == 0.25
        and tokens == 0.25
        and spec.AGGREGATIONS["batch_tokens"].micro_batch_weight(3, 8.0, 12, 20.0, trainer.loss_config) == 0.4
    )


# ---------------------------------------------------------------- sampling correction


@pytest.mark.parametrize("mode", sorted(spec.SAMPLING_CORRECTIONS))
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_sampling_correction_is_trls(mode, bounds):
    """Every mode and bound agrees with the float64 transcription of TRL's formulas, on
    drifts that cross both bounds, with a NaN the engine left and padding."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sampling = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    sampling[0, 2] = float("nan")
    mask = (torch.arange(T) < torch.tensor([7, 5, 3, 7, 1, 6]).unsqueeze(1)).double()
    out = spec.sampling_correction(old, sampling, mask, mode=mode, clip_min=bounds[0], clip_max=bounds[1])
    want = trl_sampling_correction(old, sampling, mask, mode, *bounds)
    torch.testing.assert_close(out.ratio, want, rtol=0, atol=0)
    torch.testing.assert_close(out.weights, want.expand(B, T) * mask, rtol=0, atol=0)
    cut = (want == 0) if mode.endswith("mask") else (want == want.max()) | (want == want.min())
    assert cut.any() and not cut.all()  # the bounds did act, and not on everything
    float32 = spec.sampling_correction(
        old.float(), sampling.float(), mask.float(), mode=mode, clip_min=bounds[0], clip_max=bounds[1]
    )
    assert rel_err(float32.weights, out.weights) < 1e-5


def test_sampling_correction_defaults_are_trls():
    """TRL 1.16's GRPOConfig defaults: correction on, sequence_mask, clip_max 3, no clip_min;
    for stale batches (max_staleness >= 1) the token-level truncated ratio instead."""
    trl = pytest.importorskip("trl")
    args = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)})
    ours = GRPOConfig()
    assert args.vllm_importance_sampling_correction and ours.async_.correction_mode() is not None
    assert ours.async_.correction_mode() == args.vllm_importance_sampling_mode
    assert GRPOConfig(max_staleness=1).async_.correction_mode() == "token_truncate"
    assert GRPOConfig(max_staleness=1, sampling_correction="sequence_mask").async_.correction_mode() == "sequence_mask"
    assert ours.sampling_correction_max == args.vllm_importance_sampling_clip_max
    assert ours.sampling_correction_min == args.vllm_importance_sampling_clip_min
    defaults = inspect.signature(spec.sampling_correction).parameters
    assert [defaults[k].default for k in ("mode", "clip_min", "clip_max")] == [
        args.vllm_importance_sampling_mode,
        args.vllm_importance_sampling_clip_min,
        args.vllm_importance_sampling_clip_max,
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(sampling_correction="tokens"), "sampling_correction must be one of"),
        (dict(sampling_correction_max=None), "needs sampling_correction_min or sampling_correction_max"),
        (dict(sampling_correction_min=2.0, sampling_correction_max=1.0), "sampling_correction_min must be <"),
        (dict(sampling_correction_max=-1.0), "sampling_correction_max must be"),
    ],
)
def test_bad_sampling_correction_options(options, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**options).validate()
