"""Completions with tool-result tokens (issue 27, "tool_mask"): out of the loss, context everywhere.

A multi-turn rollout's completion interleaves the model's sampled tokens with a tool's output:
``attention_mask`` is 1 on both (every forward pass sees the tool's output), ``completion_mask``
is 1 on the model's tokens only (e.g. ``1 1 0 0 1 1 0 0``: model, tool, model, pad; or a
completion that ends in a tool result), and the sampler's log-probs are 0 at tool tokens (TRL's
convention). The batches here are such samples made by hand from a rollout of the float64 demo
model (the tool spans' ids replaced by other tokens, as a tool's output would be), run through
the trainer's own stages: ``prepare`` (packing, reference log-probs, advantages, token counts)
and ``accumulate`` (the packed forward, the loss, the sampling correction).

The proof that tool positions contribute nothing: replacing every per-token value at tool
positions that the loss could read (the log-prob's target id, the sampler's, reference and old
log-probs) while the input context stays leaves the loss, its metrics and every gradient
bit-identical, and the gradient reaching the logits at tool positions is exactly 0. Then the
loss, metrics and gradients equal the float64 reference (``grpo_fast.reference``) on the padded
batch with the same masks, for grpo, dapo and dr_grpo with a KL term and the sampling
correction on, on the plain and on the fused LM head.
"""

import dataclasses

import pytest
import torch
from _steps import backward, off_policy
from conftest import completion_logits, completion_logprobs, max_err, rel_err, trl_sampling_correction

from grpo_fast import reference
from grpo_fast.packing import pack_micro_batches, to_grid
from grpo_fast.spec import LossConfig
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.model import packed_policy
from grpo_fast.trainer.model.build import reference_context
from grpo_fast.trainer.update.metrics import PhaseClock, log_line

C = 8  # max_new_tokens: the demo model's rollouts fill 1 to 8 completion tokens


def tool_trainer(tmp_path, **overrides) -> GRPOTrainer:
    """A float64 demo trainer with a KL term (its reference moved off the policy), the old
    log-probs of a second pass, the sampling correction, and a token budget that cuts a batch
    into several packed micro-batches."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=2, num_key_value_heads=2).double()
    options = dict(
        batch_size=16,
        group_size=4,
        max_new_tokens=C,
        beta=0.1,
        max_tokens_per_micro_batch=40,
        num_iterations=2,
        sampling_correction="sequence_mask",
        progress=False,
        output_dir=str(tmp_path),
        generator="sampler",
    )
    trainer = GRPOTrainer(GRPOConfig(**{**options, **overrides}), model=model, tokenizer=tokenizer)
    with torch.no_grad():
        for p in trainer.reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    return trainer


def with_tools(trainer):
    """The trainer's next samples made multi-turn: in rows with 5+ completion tokens, columns
    2-3 are a tool's output (model, tool, model, pad); in two shorter rows the completion ends
    in a 2-token tool result. Tool tokens get other ids, attention 1, completion_mask 0 and
    sampler log-probs 0; the model tokens' sampler log-probs are the policy's plus noise."""
    samples = trainer.source.next(trainer.data_position, trainer.version)
    real = samples.attention_mask[:, -C:].bool()  # [N, C] the completions' real tokens
    lengths = real.sum(1)
    assert lengths.min() < 5 <= lengths.max()
    tool = torch.zeros_like(real)
    tool[lengths >= 5, 2:4] = True
    for row in [i for i, n in enumerate(lengths.tolist()) if 3 <= n < 5][:2]:
        tool[row, lengths[row] - 2 : lengths[row]] = True  # ends in a tool result
    assert tool.any(1).sum() >= 6 and (tool & ~real).sum() == 0
    g = torch.Generator().manual_seed(5)
    ids = samples.input_ids.clone()
    ids[:, -C:] = torch.where(tool, torch.randint(3, 15, (len(ids), C), generator=g), ids[:, -C:])
    mask = samples.completion_mask * ~tool
    policy_logp = completion_logprobs(trainer.policy, ids, samples.attention_mask, C)
    noise = 0.05 * torch.randn(policy_logp.shape, generator=g, dtype=policy_logp.dtype)
    samples = dataclasses.replace(
        samples, input_ids=ids, completion_mask=mask, sampling_logprobs=(policy_logp + noise) * mask
    )
    return samples, tool


def tool_batch(trainer):
    """``(batch, tool [N, C])``: the trainer's step batch of :func:`with_tools`'s samples, with
    random advantages (a signal whatever the rewards)."""
    samples, tool = with_tools(trainer)
    batch = trainer.prepare(samples)
    assert len(batch.micro_batches) > 2
    batch.advantages = torch.randn(len(tool), generator=torch.Generator().manual_seed(1))
    return batch, tool


def gradients(trainer) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.grad is not None])
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def two_passes(trainer, batch) -> list:
    """The step's two passes: the first (on-policy, the sampling correction applied and
    recorded), the second from off-policy old log-probs with the first's weights. ``[(metrics,
    gradients, PassResult, Proximal)]``, the second's Proximal the one it ran with."""
    metrics, first = backward(trainer, batch)
    out = [(metrics, gradients(trainer), first, None)]
    proximal = dataclasses.replace(off_policy(trainer, batch), importance_weights=first.weights)
    metrics, second = backward(trainer, batch, proximal)
    return out + [(metrics, gradients(trainer), second, proximal)]


def reference_pass(trainer, batch, old, weights):
    """The float64 reference on the padded batch: loss output and parameter gradients."""
    samples, mask = batch.samples, batch.completion_mask
    with reference_context(trainer.policy, trainer.reference):
        ref = completion_logprobs(trainer.reference, samples.input_ids, samples.attention_mask, C)
    logits = completion_logits(trainer.policy, samples.input_ids, samples.attention_mask, C)
    config = trainer.loss_config
    out = reference.grpo_loss(
        logits,
        samples.input_ids[:, -C:],
        batch.advantages,
        mask,
        old,
        ref,
        importance_weights=weights,
        num_items_in_batch=mask.sum(),
        return_entropy=True,
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(LossConfig)},
    )
    out.loss.backward()
    return out, gradients(trainer)


CASES = [
    dict(loss_type="grpo", sampling_correction="sequence_mask"),
    dict(loss_type="dapo", sampling_correction="token_truncate"),
    dict(loss_type="dr_grpo", sampling_correction="token_mask", fused_linear=True),
]


@pytest.mark.usefixtures("float64_norms")  # Llama's norm in float64 (tests/_float64.py)
@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(str(v) for v in case.values()))
def test_loss_and_gradients_equal_the_float64_reference(tmp_path, case):
    """Both passes of a step on a batch with tool tokens equal the reference with the same
    masks: loss, KL and entropy, gradients; the correction's weights are TRL's, 0 at tools."""
    trainer = tool_trainer(tmp_path, **case)
    batch, tool = tool_batch(trainer)
    mask, correction = batch.completion_mask, trainer.config.async_.correction_options()
    (_, _, first, _), second = passes = two_passes(trainer, batch)
    policy_logp = completion_logprobs(trainer.policy, batch.samples.input_ids, batch.samples.attention_mask, C)
    weights = trl_sampling_correction(policy_logp, batch.samples.sampling_logprobs, mask, **correction)
    weights = weights.expand_as(mask) * mask
    assert max_err(first.weights, weights) < 1e-12 and (first.weights[tool] == 0).all()
    assert (first.weights[mask.bool()] > 0).float().mean() > 0.5  # the correction keeps most rows
    for (metrics, grads, _, proximal), old in zip(passes, [None, second[3].logprobs]):
        out, expected = reference_pass(trainer, batch, old, weights)
        assert expected.norm() > 0 and out.kl > 0
        assert rel_err(grads, expected) < 1e-10 and max_err(grads, expected) < 1e-10
        assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-10, abs=1e-12)
        for key in ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):  # float32 metrics
            assert metrics[key] == pytest.approx(getattr(out, key).item(), rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("fused_linear", [False, True], ids=["plain", "fused"])
def test_tool_positions_contribute_nothing(tmp_path, monkeypatch, fused_linear):
    """Every value the loss could read at tool positions replaced (the log-prob targets, the
    sampler's, reference and old log-probs), the input context unchanged: the loss, metrics,
    correction weights and gradients of both passes are bit-identical. On the plain LM head
    the gradient reaching the logits at tool positions is exactly 0."""
    trainer = tool_trainer(tmp_path, fused_linear=fused_linear, importance_sampling="sequence")
    batch, tool = tool_batch(trainer)
    logits = []
    if not fused_linear:

        def keep(model, packed):
            out = packed_logits(model, packed)
            out.retain_grad()
            logits.append((packed, out))
            return out

        packed_logits = packed_policy.packed_logits
        monkeypatch.setattr(packed_policy, "packed_logits", keep)
    before = two_passes(trainer, batch)
    for packed, out in logits:
        at_tools = to_grid(out.grad.abs().sum(-1), packed)  # [n, C]
        assert (at_tools[tool[packed.rows]] == 0).all() and (
            at_tools[batch.completion_mask[packed.rows].bool()] > 0
        ).all()

    def at_tools(x, value):  # [N, C]: ``value`` at the tool positions
        return torch.where(tool, value, x)

    moved = []
    for packed in batch.micro_batches:
        is_tool = tool[packed.rows][packed.grid].unsqueeze(0)  # [1, Nc]
        assert is_tool.any()
        moved.append(packed._replace(targets=torch.where(is_tool, (packed.targets + 5) % 15, packed.targets)))
    samples = dataclasses.replace(batch.samples, sampling_logprobs=at_tools(batch.samples.sampling_logprobs, -7.0))
    changed = dataclasses.replace(
        batch, samples=samples, micro_batches=moved, ref_logprobs=at_tools(batch.ref_logprobs, 3.0)
    )
    proximal = before[1][3]
    noisy = dataclasses.replace(proximal, logprobs=at_tools(proximal.logprobs, 5.0))
    metrics, first = backward(trainer, changed)
    after = [(metrics, gradients(trainer), first)]
    metrics, second = backward(trainer, changed, noisy)
    after.append((metrics, gradients(trainer), second))
    model = batch.completion_mask.bool()
    for (metrics, grads, result, _), (metrics2, grads2, result2) in zip(before, after):
        assert metrics == metrics2 and torch.equal(grads, grads2)
        if result.weights is not None:
            assert torch.equal(result.weights, result2.weights) and (result.weights[tool] == 0).all()
        if result.logprobs is not None:  # the recorded log-probs gather the moved targets at tools
            assert torch.equal(result.logprobs[model], result2.logprobs[model])
            assert (result.logprobs[tool] != result2.logprobs[tool]).all()


def test_packed_log_probs_attend_over_tool_tokens(tmp_path):
    """The packed micro-batches (cut by the attention mask's token counts) give the padded
    forward's log-probs on every real completion token, tool tokens included, and the
    reference's on the model's; tool tokens are context: a tool token's id moves the log-prob of
    the model token after it (and its own), and nothing before it."""
    trainer = tool_trainer(tmp_path)
    batch, tool = tool_batch(trainer)
    samples, model = batch.samples, batch.completion_mask.bool()
    real = samples.attention_mask[:, -C:].bool()
    assert (tool & real).sum() == tool.sum() and (model | tool).eq(real).all()
    for packed in batch.micro_batches:
        assert packed.completion_cu_seqlens.diff().tolist() == real[packed.rows].sum(1).tolist()

    def packed_logprobs(input_ids):
        micro = pack_micro_batches(input_ids, samples.attention_mask, C, 40, None)
        with torch.no_grad():
            return torch.cat([trainer.modules.train(packed) for packed in micro])

    padded = completion_logprobs(trainer.policy, samples.input_ids, samples.attention_mask, C)
    packed = packed_logprobs(samples.input_ids)
    assert rel_err(packed[real], padded[real]) < 1e-12 and max_err(packed[real], padded[real]) < 1e-12
    with reference_context(trainer.policy, trainer.reference):
        ref = completion_logprobs(trainer.reference, samples.input_ids, samples.attention_mask, C)
    assert rel_err(batch.ref_logprobs[model], ref[model]) < 1e-12

    row = int((real.sum(1) >= 5).nonzero()[0])  # model, model, tool, tool, model...
    ids = samples.input_ids.clone()
    ids[row, -C + 3] = (ids[row, -C + 3] + 5) % 15  # the second tool token
    moved = packed_logprobs(ids)
    assert torch.equal(moved[row, :3], packed[row, :3]) and (moved[row, 4] - packed[row, 4]).abs() > 1e-6
    assert torch.equal(moved[:row], packed[:row]) and torch.equal(moved[row + 1 :], packed[row + 1 :])


def test_fused_linear_equals_plain_with_tool_tokens(tmp_path):
    """The fused LM head's loss, metrics and gradients equal the plain head's on both passes."""
    trainer = tool_trainer(tmp_path)
    batch, _ = tool_batch(trainer)
    plain = two_passes(trainer, batch)
    trainer.config.fused_linear = True
    proximal = plain[1][3]
    metrics, first = backward(trainer, batch)
    fused = [(metrics, gradients(trainer), first)]
    metrics, _ = backward(trainer, batch, proximal)
    fused.append((metrics, gradients(trainer), None))
    assert rel_err(first.weights, plain[0][2].weights) < 1e-12
    for (want, want_grads, _, _), (got, grads, _) in zip(plain, fused):
        assert rel_err(grads, want_grads) < 1e-10 and max_err(grads, want_grads) < 1e-10
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_token_counts_are_the_model_tokens(tmp_path):
    """The loss normalisers (dapo's global token count, grpo's per-sequence means, via the
    reference test) and the logged completion length count the model's tokens only, as TRL's
    ``completions/mean_length`` with tools; ``tokens_per_s`` counts every token processed."""
    trainer = tool_trainer(tmp_path, loss_type="dapo")
    batch, tool = tool_batch(trainer)
    mask = batch.completion_mask
    assert batch.num_items == mask.sum() and tool.sum() > 0
    assert torch.equal(batch.scores[:, 1], mask.sum(1))
    line = log_line(
        0,
        batch,
        [],
        PhaseClock(trainer.runtime.device),
        trainer.runtime,
        learning_rate=0.0,
        extra={},
        sampling={},
        dynamic_sampling=False,
        reward_names=[],
    )
    assert line["completion_len_mean"] == pytest.approx(mask.sum(1).mean().item())
    real = batch.samples.attention_mask[:, -C:].sum()
    assert line["completion_len_mean"] * len(mask) < real.item()
