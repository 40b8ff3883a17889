"""The runtime: what --precision means, decided once per device, read by every forward and logged;
the engines' settings; the step's stage clock."""

import dataclasses
import logging

import pytest
import torch
from conftest import small_config

from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator
from grpo_fast.trainer.runtime import Runtime, decide_precision
from grpo_fast.trainer.update.metrics import PhaseClock

CPU = torch.device("cpu")


def test_precision_is_one_decision_per_device():
    assert [decide_precision(p, CPU) for p in ("auto", "bf16", "fp32")] == [False, True, False]
    with pytest.raises(ValueError, match="precision must be one of \\('auto', 'bf16', 'fp32'\\), got 'fp16'"):
        decide_precision("fp16", CPU)
    runtime = Runtime(CPU, bf16=True)
    assert runtime.dtype is torch.bfloat16 and Runtime(CPU).dtype is torch.float32
    assert runtime.on("cpu", "fp32").bf16 is False and runtime.on("cpu", "bf16").ranks is runtime.ranks
    with runtime.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    with Runtime(CPU).autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32


@pytest.mark.parametrize("generator", ["sampler", "hf"])
def test_bf16_on_cpu_reaches_every_forward_and_is_logged(tmp_path, generator, caplog):
    """--precision bf16 on a CPU: the rollout's forwards (our sampler, or HF generate), the
    reference pass and the training pass all compute in bf16 (the LM head's output dtype, seen
    by a hook), the weights stay float32, and the trainer logs what it chose."""
    config = small_config(tmp_path, precision="bf16", generator=generator, beta=0.04)
    with caplog.at_level(logging.INFO, logger="grpo_fast"):
        trainer = GRPOTrainer(config)
    assert "trainer on cpu: --precision bf16 -> bf16 for every forward" in caplog.text
    seen = []
    head = trainer.policy.get_output_embeddings()
    handles = [
        module.register_forward_hook(lambda m, args, out: seen.append((torch.is_grad_enabled(), out.dtype)))
        for module in dict.fromkeys([head, trainer.reference.get_output_embeddings()])
    ]
    try:
        metrics = trainer.train_step()
    finally:
        for handle in handles:
            handle.remove()
    assert {dtype for _, dtype in seen} == {torch.bfloat16}
    assert any(grad for grad, _ in seen) and any(not grad for grad, _ in seen)  # rollout/reference and training
    assert all(p.dtype is torch.float32 for p in trainer.policy.parameters())
    assert metrics["loss"] is not None and metrics["kl"] is not None
    stages = [metrics[f"time/{stage}_s"] for stage in ("rollout", "prepare", "update")]
    assert all(t > 0 for t in stages) and sum(stages) <= metrics["step_time_s"]  # each stage did work


def test_engine_settings_are_the_configs_and_nothing_else():
    """EngineSettings copies its fields from the run's config by name; the evaluation's
    temperature is a change of the settings, and an engine refuses a config in their place."""
    config = GRPOConfig(temperature=0.7, top_k=3, seed=5)
    settings = EngineSettings.of(config, temperature=0.3)
    assert settings.temperature == 0.3 and settings.top_k == 3 and settings.seed == 5
    assert {f.name for f in dataclasses.fields(EngineSettings)} <= {f.name for f in dataclasses.fields(GRPOConfig)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.temperature = 1.0
    from grpo_fast.tasks.arithmetic import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    with pytest.raises(TypeError, match="settings must be an EngineSettings"):
        make_generator("sampler", build_model(tokenizer), tokenizer, config)


def test_the_stage_clock_splits_the_step():
    clock = PhaseClock(CPU)
    sum(range(200_000))
    clock.mark("rollout")
    clock.mark("prepare")
    sum(range(400_000))
    clock.mark("update")
    seconds = clock.seconds()
    assert list(seconds) == ["time/rollout_s", "time/prepare_s", "time/update_s"]
    assert seconds["time/rollout_s"] > seconds["time/prepare_s"] >= 0 and seconds["time/update_s"] > 0
