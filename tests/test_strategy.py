"""The step's strategy (``trainer/update/strategy.py``) against GRPO's own step: per-token
advantages that repeat each sequence's train exactly as the sequences' do, and a strategy's
part is stepped, logged, checkpointed and restored by the trainer alone."""

import dataclasses

import pytest
import torch

from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.run.run_log import TIMING_KEYS
from grpo_fast.trainer.update.optimization import adamw, lr_scheduler
from grpo_fast.trainer.update.strategy import Strategy, TrainedPart

OPTIONS = dict(batch_size=8, group_size=4, max_new_tokens=3, progress=False, beta=0.04, num_iterations=2)


def untimed(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if key not in TIMING_KEYS}


class PerToken(Strategy):
    """GRPO's advantages, each sequence's repeated on every completion token: [N] -> [N, C]."""

    def prepare(self, batch):
        per_token = batch.advantages[:, None].expand_as(batch.completion_mask).contiguous()
        return dataclasses.replace(batch, advantages=per_token)


def test_per_token_advantages_train_as_the_sequences_do(tmp_path):
    runs = {}
    for name, strategy in (("grpo", None), ("per_token", PerToken())):
        trainer = GRPOTrainer(GRPOConfig(**OPTIONS, steps=2, output_dir=str(tmp_path)), strategy=strategy)
        results = [trainer.run_step() for _ in range(2)]
        weights = [p.detach().clone() for p in trainer.policy.parameters()]
        runs[name] = [untimed(r.metrics) for r in results], [r.batch.advantages.dim() for r in results], weights
    (grpo, grpo_dims, grpo_weights), (per_token, per_token_dims, per_token_weights) = runs.values()
    assert grpo_dims == [1, 1] and per_token_dims == [2, 2]  # the loss did read [N, C]
    assert grpo[0]["loss"] != 0 and grpo[0]["grad_norm"] > 0  # the compared steps do train
    assert per_token == grpo
    for a, b in zip(grpo_weights, per_token_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Scale(Strategy):
    """A part of its own: a scalar w trained to the batch's mean reward by (w - mean)^2."""

    def attach(self, trainer):
        module = torch.nn.Linear(1, 1, bias=False)
        optimizer = adamw(module.parameters(), trainer.config.optim, lr=0.1)
        scheduler = lr_scheduler(optimizer, trainer.config.optim, trainer.config.rollout)
        self.part = TrainedPart(module, optimizer, scheduler)
        self.calls = []

    def parts(self):
        return {"scale": self.part}

    def backward(self, batch):
        target = batch.stats.rewards.nan_to_num().mean()
        loss = (self.part.module.weight.sum() - target) ** 2
        loss.backward()
        self.calls.append(self.part.module.weight.grad.norm().item())
        return dict(scale_loss=loss.detach())

    def metrics(self, batch):
        return dict(scale=self.part.module.weight.item())


def test_a_strategys_part_is_stepped_logged_and_checkpointed(tmp_path):
    config = GRPOConfig(**OPTIONS, steps=2, save_every=1, output_dir=str(tmp_path))
    trainer = GRPOTrainer(config, strategy=Scale())
    start = trainer.strategy.part.module.weight.item()
    metrics = trainer.train_step()
    calls = trainer.strategy.calls
    assert len(calls) == config.num_iterations
    assert metrics["scale_grad_norm"] == pytest.approx(sum(calls) / len(calls))
    assert metrics["scale"] == trainer.strategy.part.module.weight.item() != start
    assert metrics["scale_loss"] > 0
    trainer.save_checkpoint()
    saved, saved_epoch = trainer.strategy.part.module.weight.item(), trainer.strategy.part.scheduler.last_epoch
    trainer.train_step()  # moves it on; the resume below must bring back the saved one

    resumed = GRPOTrainer(config, strategy=Scale())
    assert resumed.resume() == 1
    assert resumed.strategy.part.module.weight.item() == saved
    moments = resumed.strategy.part.optimizer.state[resumed.strategy.part.module.weight]
    assert moments["step"].item() == config.num_iterations  # AdamW's state came back too
    assert resumed.strategy.part.scheduler.last_epoch == saved_epoch > 1  # 1: a fresh schedule's
