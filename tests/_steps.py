"""Test helpers that take a trainer's step apart: its next batch, an off-policy first pass, a
re-cut of the micro-batches, one training pass with its metrics read."""

import dataclasses

import torch
from conftest import completion_logprobs

from grpo_fast.trainer.model.packing import pack_rollout
from grpo_fast.trainer.update.metrics import read_metrics
from grpo_fast.trainer.update.passes import Proximal


def next_batch(trainer):
    """The trainer's next step batch: its source's next samples, prepared."""
    return trainer.prepare(trainer.source.next(trainer.data_position, trainer.version))


def off_policy(trainer, batch, scale: float = 0.3) -> Proximal:
    """A first pass's view of ``batch`` whose log-probs are ``scale``-normal noise away from
    the policy's (0 past each completion): the later passes' old log-probs (num_iterations >
    1), so that ratios leave the trust region and clip."""
    samples, mask = batch.samples, batch.completion_mask
    old = completion_logprobs(trainer.policy, samples.input_ids, samples.attention_mask, mask.shape[1])
    noise = scale * torch.randn(old.shape, generator=torch.Generator().manual_seed(0), dtype=old.dtype)
    return Proximal((old + noise) * mask, None, {})


def repacked(trainer, batch):
    """``batch`` with its micro-batches cut anew under the trainer's config's limits."""
    samples = batch.samples
    micro = pack_rollout(
        samples.input_ids, samples.attention_mask, batch.completion_mask.shape[1], trainer.config, trainer.policy
    )
    return dataclasses.replace(batch, micro_batches=micro)


def backward(trainer, batch, proximal=None) -> tuple:
    """``(metrics as numbers, PassResult)`` of one training pass over ``batch``."""
    result = trainer.accumulate_gradients(batch, proximal)
    return read_metrics([result.metrics], trainer.runtime.ranks, trainer.runtime.device)[0], result
