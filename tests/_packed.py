"""The packed step against its padded truth, for the packing tests: a float64 trainer whose
batch cuts into several packs, the padded step's loss and gradients, and a padded rollout of
groups of several prompt and completion lengths."""

import pytest
import torch
from _steps import backward, next_batch, off_policy
from conftest import completion_logits, completion_logprobs, max_err, rel_err

from grpo_fast import grpo_loss
from grpo_fast.packing.cost import HOST_COSTS
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.model.build import reference_context

C = 5  # the completions' columns of rollout()


def a_call_per_length(monkeypatch, replayed: bool = False) -> None:
    """Packs on this host split their attention into a call per span length: a call and a grid
    row cost nothing fixed, so only equal lengths share one (``packing.cost``). ``replayed``:
    a mask costs 100x a causal pair too, so the completions after a prompt attend as causal
    rows of [prompt | completion] (``grids._replays_prefix``)."""
    fitted = HOST_COSTS["cpu"]
    masked = 100 * fitted.causal if replayed else fitted.masked
    monkeypatch.setitem(HOST_COSTS, "cpu", fitted._replace(call=0.0, row=0.0, masked=masked))


def float64_trainer(tmp_path, **overrides) -> GRPOTrainer:
    """A trainer on a float64 copy of the demo model with grouped-query attention, completions
    of 1 to 6 tokens, a KL term, and a token budget that cuts the batch into several packs."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=2, num_key_value_heads=2).double()
    config = GRPOConfig(
        batch_size=16,
        group_size=4,
        max_new_tokens=6,
        beta=0.1,
        max_tokens_per_micro_batch=30,
        eps_high=5.0 if overrides.get("loss_type") == "cispo" else None,
        progress=False,
        output_dir=str(tmp_path),
        generator="sampler",
        num_iterations=2,  # the old log-probs are the first pass's: the proximal policy's
        **overrides,
    )
    return GRPOTrainer(config, model=model, tokenizer=tokenizer)


def padded_step(trainer, batch, proximal):
    """The padded truth: loss output and parameter gradients of one full-batch backward."""
    C, samples = batch.completion_mask.shape[1], batch.samples
    logits = completion_logits(trainer.policy, samples.input_ids, samples.attention_mask, C)
    out = grpo_loss(
        logits,
        samples.input_ids[:, -C:],
        batch.advantages,
        batch.completion_mask,
        proximal.logprobs,
        batch.ref_logprobs,
        num_items_in_batch=batch.num_items,
        return_entropy=True,
        loss_config=trainer.loss_config,
    )
    out.loss.backward()
    return out, gradients(trainer)


def gradients(trainer) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.grad is not None])
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def off_policy_batch(trainer) -> tuple:
    """``(batch, proximal)``: the next step batch, its reference log-probs (packed) checked
    against padded ones, random advantages (a signal, whatever was sampled), and a first
    pass's view whose log-probs are 0.3-normal noise away from the policy's, so that ratios clip."""
    batch = next_batch(trainer)
    C, samples = batch.completion_mask.shape[1], batch.samples
    m = batch.completion_mask.bool()
    with reference_context(trainer.policy, trainer.reference):
        ref = completion_logprobs(trainer.reference, samples.input_ids, samples.attention_mask, C)
    assert batch.ref_logprobs.dtype == torch.float64 and rel_err(batch.ref_logprobs[m], ref[m]) < 1e-12
    batch.advantages = torch.randn(batch.completion_mask.shape[0], generator=torch.Generator().manual_seed(1))
    return batch, off_policy(trainer, batch)


def assert_packed_equals_padded(trainer):
    batch, proximal = off_policy_batch(trainer)
    lengths = batch.completion_mask.sum(1)
    assert lengths.min() < lengths.max() and len(batch.micro_batches) > 2
    sums, _ = backward(trainer, batch, proximal)
    packed_grads = gradients(trainer)
    out, padded_grads = padded_step(trainer, batch, proximal)
    assert padded_grads.norm() > 0
    assert rel_err(packed_grads, padded_grads) < 1e-10 and max_err(packed_grads, padded_grads) < 1e-10
    assert sums["loss"] == pytest.approx(out.loss.item(), rel=1e-10, abs=1e-12)
    for key in ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):  # float32 metrics
        assert sums[key] == pytest.approx(getattr(out, key).item(), rel=1e-6, abs=1e-9), key
    return out


def rollout(group_size: int, prompt_lengths: list, seed: int = 0):
    """A padded rollout of len(prompt_lengths) groups: [N, P + C] input_ids and attention mask,
    each group's rows one prompt (left-padded), completions of 1 to C tokens (right-padded),
    the first row of every group C long and the last 1 long."""
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lengths)
    rows, masks = [], []
    for length in prompt_lengths:
        prompt = torch.randint(3, 15, (length,), generator=g)
        for i in range(group_size):
            n = C if i == 0 else 1 if i == group_size - 1 else int(torch.randint(1, C + 1, (), generator=g))
            completion = torch.randint(3, 15, (n,), generator=g)
            ids = torch.zeros(P + C, dtype=torch.long)
            ids[P - length : P] = prompt
            ids[P : P + n] = completion
            mask = torch.zeros(P + C, dtype=torch.long)
            mask[P - length : P + n] = 1
            rows.append(ids)
            masks.append(mask)
    return torch.stack(rows), torch.stack(masks)
