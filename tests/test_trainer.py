"""The trainer: rollout bookkeeping, micro-batch invariance, resume, --model, bad input.

Runs use the demo's tiny model with a small batch (G=4, 16 completions) so each step
takes tens of milliseconds; the full default demo run is in tests/test_cli.py.
"""

import copy
import dataclasses
import json
import math
import os
import re
import shutil

import pytest
import torch
from _steps import backward, next_batch, off_policy, repacked
from conftest import completion_logits, completion_logprobs, max_err, rel_err, small_config

import grpo_fast
from grpo_fast import reference
from grpo_fast.spec import LOSS_TYPES
from grpo_fast.tasks.arithmetic import arithmetic_reward, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer, RewardError, choices
from grpo_fast.trainer.choices import LR_SCHEDULES
from grpo_fast.trainer.rollout.engines import EngineSettings, Generation, Generator
from grpo_fast.trainer.rollout.engines.hf import HFGenerator
from grpo_fast.trainer.rollout.samples import score
from grpo_fast.trainer.run import checkpoint as ckpt
from grpo_fast.trainer.run.run_log import METRIC_KEYS, TIMING_KEYS, read_metrics
from grpo_fast.trainer.update.optimization import (
    SCHEDULES,
    load_schedule_state,
    lr_scheduler,
    schedule_factor,
    schedule_state,
)

# ---------------------------------------------------------------- rollout


def test_generate_masks_stop_at_first_eos_and_logprobs_match_sampler():
    """Left-padded prompts of different lengths: the completion mask covers tokens up to the
    first EOS, and the recomputed log-probs equal those of the distribution that sampled."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=1)
    prompts = ["1+2=", "9+0=11+", "3+", "4+4="]
    generator = HFGenerator(model, tokenizer, EngineSettings.of(GRPOConfig(max_new_tokens=6)))
    out = generator.generate(prompts, 2)
    input_ids, attention_mask, completion_mask, completions = out[:4]
    prompts = [p for p in prompts for _ in range(2)]
    C = completion_mask.shape[1]
    completion_ids = input_ids[:, -C:]
    eos = tokenizer.eos_token_id
    for row, mask in zip(completion_ids.tolist(), completion_mask.tolist()):
        n = int(sum(mask))
        assert mask == [1.0] * n + [0.0] * (C - n)
        assert eos not in row[: n - 1]  # no EOS before the last active token
        assert n == C or row[n - 1] == eos
    assert completions == tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    # Truth: the same sequences, each run alone without padding, full logits, reference log-softmax.
    logp = completion_logprobs(model, input_ids, attention_mask, C)
    P = input_ids.shape[1] - C
    for b in range(len(prompts)):
        n = int(completion_mask[b].sum())
        prompt = input_ids[b, :P][attention_mask[b, :P].bool()]
        alone = torch.cat([prompt, completion_ids[b, :n]]).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=alone).logits[:, len(prompt) - 1 : -1]
        truth = reference.token_logprobs(logits.double(), completion_ids[b : b + 1, :n])[0]
        assert rel_err(logp[b, :n], truth) < 1e-5


def test_completion_logits_keep_only_completion_positions():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    ids = torch.randint(3, len(tokenizer), (2, 7))
    mask = torch.ones_like(ids)
    logits = completion_logits(model, ids, mask, 3)
    assert logits.shape == (2, 3, len(tokenizer))
    full = model(input_ids=ids).logits[:, 3:6]
    assert rel_err(logits, full) < 1e-5


def test_reward_error_names_function_and_sample():
    def picky_reward(prompts, completions, **columns):
        return [1.0 / len(c) for c in completions]  # raises on the empty completion

    with pytest.raises(RewardError, match=r"'picky_reward'.*ZeroDivisionError.*sample 2 \(prompt='c'"):
        score([picky_reward], ["a", "b", "c"], ["x", "yy", ""], {})
    with pytest.raises(RewardError, match="returned 1 scores for 2 completions"):
        score([lambda p, c, **k: [0.0]], ["a", "b"], ["x", "y"], {})
    for bad in (math.nan, math.inf, -math.inf, "1.0"):  # None stays "unscored"

        def odd_reward(prompts, completions, **columns):
            return [None, bad]

        with pytest.raises(RewardError, match=rf"'odd_reward' returned {re.escape(repr(bad))} .*finite.* sample 1 "):
            score([odd_reward], ["a", "b"], ["x", "y"], {})


def test_score_none_is_nan_and_extra_columns_reach_the_function():
    def graded_only(prompts, completions, answer, graded, **columns):
        return [float(c == a) if g else None for c, a, g in zip(completions, answer, graded)]

    columns = {"answer": ["2", "2", "2"], "graded": [True, False, True]}
    scores = score([graded_only, arithmetic_reward], ["1+1="] * 3, ["2", "2", "x"], columns)
    assert scores.shape == (3, 2)
    assert scores[0].tolist() == [1.0, 1.0] and torch.isnan(scores[1, 0]) and scores[2].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- the update


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_give_the_full_batch_gradient(tmp_path, loss_type):
    """Gradient accumulation over packed micro-batches cut by rows (3, uneven) or by a token
    budget equals one full-batch backward, for every loss type of the spec."""
    eps_high = 5.0 if loss_type == "cispo" else None
    config = small_config(tmp_path, loss_type=loss_type, beta=0.1, eps_high=eps_high, num_iterations=2)
    trainer = GRPOTrainer(config)
    batch = next_batch(trainer)
    proximal = off_policy(trainer, batch)
    assert batch.ref_logprobs is not None
    grads = []
    for rows, budget in ((None, None), (3, None), (None, 24)):
        trainer.config.micro_batch_size, trainer.config.max_tokens_per_micro_batch = rows, budget
        batch = repacked(trainer, batch)
        metrics, _ = backward(trainer, batch, proximal)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))
        trainer.optimizer.zero_grad(set_to_none=True)
        assert all(metrics[k] is not None for k in ("loss", "kl", "entropy"))
    assert len(batch.micro_batches) > 3  # the budget did cut (16 rows of 5 to 11 tokens)
    assert grads[0].norm() > 0
    assert (
        rel_err(grads[1], grads[0]) < 1e-5
        and max_err(grads[1], grads[0]) < 1e-5
        and rel_err(grads[2], grads[0]) < 1e-5
        and max_err(grads[2], grads[0]) < 1e-5
    )


def test_fused_linear_loss_gives_the_logits_path_gradient(tmp_path):
    """fused_linear=True (loss from hidden states and the LM head) against the logits path."""
    trainer = GRPOTrainer(small_config(tmp_path, beta=0.1, micro_batch_size=6, num_iterations=2))
    batch = next_batch(trainer)
    proximal = off_policy(trainer, batch)
    grads, metrics, logprobs = [], [], []
    for fused in (False, True):
        trainer.config.fused_linear = fused
        # the first pass (its log-probs recorded) with the clip's old log-probs of the later ones
        first = trainer.accumulate_gradients(batch, None).logprobs
        trainer.optimizer.zero_grad(set_to_none=True)
        metrics.append(backward(trainer, batch, proximal)[0])
        logprobs.append(first)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))
        trainer.optimizer.zero_grad(set_to_none=True)
    assert grads[0].norm() > 0
    assert rel_err(grads[1], grads[0]) < 1e-5 and max_err(grads[1], grads[0]) < 1e-5
    for key in ("loss", "kl", "entropy", "clip_ratio_region"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7), key
    assert metrics[0]["clip_ratio_region"] > 0  # the old log-probs were off-policy enough to clip
    # The first pass's log-probs (the old policy's when num_iterations > 1) are the policy's own.
    m, samples = batch.completion_mask.bool(), batch.samples
    truth = completion_logprobs(
        trainer.policy, samples.input_ids, samples.attention_mask, batch.completion_mask.shape[1]
    )
    assert rel_err(logprobs[0][m], truth[m]) < 1e-5
    assert rel_err(logprobs[1][m], truth[m]) < 1e-5


def test_gradient_checkpointing_gives_the_same_gradient(tmp_path):
    """Recomputing activations in the backward (the packed attention holds through it) changes
    no gradient, with the full model and with LoRA; keeping one layer input in two
    (checkpoint_every = 2: the demo model's two layers one run) gives every layer input's
    gradient bit for bit; the MLPs in tiles of 5 positions (mlp_tile_tokens, on top) give it to
    float32's precision."""
    for lora_r in (0, 4):
        grads = []
        for checkpointing, every, tiles in ((False, 1, 0), (True, 1, 0), (True, 2, 0), (True, 2, 5)):
            config = small_config(tmp_path, beta=0.1, max_tokens_per_micro_batch=24, lora_r=lora_r, num_iterations=2)
            config.gradient_checkpointing, config.checkpoint_every, config.mlp_tile_tokens = checkpointing, every, tiles
            tokenizer = build_tokenizer()
            trainer = GRPOTrainer(config, model=build_model(tokenizer, seed=2), tokenizer=tokenizer)
            if not grads:
                batch = next_batch(trainer)
                proximal = off_policy(trainer, batch)
            trainer.accumulate_gradients(batch, proximal)
            grads.append(torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.requires_grad]))
        assert grads[0].norm() > 0 and rel_err(grads[1], grads[0]) < 1e-6 and max_err(grads[1], grads[0]) < 1e-6, lora_r
        assert torch.equal(grads[2], grads[1]), lora_r
        assert rel_err(grads[3], grads[1]) < 1e-6 and max_err(grads[3], grads[1]) < 1e-6, lora_r


def test_reference_is_none_copy_or_lora_without_adapters(tmp_path):
    assert GRPOTrainer(small_config(tmp_path, beta=0.0)).reference is None
    trainer = GRPOTrainer(small_config(tmp_path, beta=0.1))
    assert trainer.reference is not trainer.policy
    assert not any(p.requires_grad for p in trainer.reference.parameters())

    tokenizer = build_tokenizer()
    base = build_model(tokenizer, seed=3)
    frozen = copy.deepcopy(base)
    lora = GRPOTrainer(small_config(tmp_path, beta=0.1, lora_r=4), model=base, tokenizer=tokenizer)
    assert lora.reference is lora.policy  # no second copy of the weights
    for _ in range(2):  # after an update the adapters are non-zero, so policy != reference
        lora.train_step()
    batch = next_batch(lora)
    C, samples = batch.completion_mask.shape[1], batch.samples
    truth = completion_logprobs(frozen, samples.input_ids, samples.attention_mask, C)
    policy = completion_logprobs(lora.policy, samples.input_ids, samples.attention_mask, C)
    m = batch.completion_mask.bool()
    assert rel_err(batch.ref_logprobs[m], truth[m]) < 1e-5
    assert rel_err(policy[m], truth[m]) > 1e-4


# ---------------------------------------------------------------- runs, checkpoints, resume


def test_metrics_checkpoints_and_final_model(tmp_path):
    trainer = GRPOTrainer(small_config(tmp_path, steps=4, save_every=2, keep_checkpoints=1))
    history = trainer.train()
    run = tmp_path / "run"
    logged = read_metrics(str(run))
    assert [m["step"] for m in logged] == [1, 2, 3, 4] and logged == json.loads(json.dumps(history))
    for m in logged:
        assert set(METRIC_KEYS) <= set(m)
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["completion_len_mean"] >= 1 and m["kl"] >= 0
    assert os.listdir(run / "checkpoints") == ["step-000004"]  # keep_checkpoints=1, no temp folders
    assert (run / "reward.png").stat().st_size > 0
    reloaded = type(trainer.policy).from_pretrained(run / "final")
    for (name, p), q in zip(trainer.policy.named_parameters(), reloaded.parameters()):
        assert torch.equal(p, q), name


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Run 6 steps; copy the run, drop its last checkpoint (as if killed after step 4),
    resume: steps 5 and 6 log exactly the same metrics (all but timings)."""
    config = dict(steps=6, save_every=2, keep_checkpoints=3, lr_schedule="cosine", num_iterations=2, beta=0.05)
    GRPOTrainer(small_config(tmp_path, **config)).train()
    full = read_metrics(str(tmp_path / "run"))
    shutil.copytree(tmp_path / "run", tmp_path / "cut")
    shutil.rmtree(ckpt.checkpoint_path(str(tmp_path / "cut"), 6))

    resumed = GRPOTrainer(small_config(tmp_path, output_dir=str(tmp_path / "cut"), **config))
    assert resumed.resume() == 4
    assert [m["step"] for m in read_metrics(str(tmp_path / "cut"))] == [1, 2, 3, 4]
    resumed.train()
    again = read_metrics(str(tmp_path / "cut"))
    drop = set(TIMING_KEYS)
    assert [{k: v for k, v in m.items() if k not in drop} for m in again] == [
        {k: v for k, v in m.items() if k not in drop} for m in full
    ]
    assert len({m["reward_mean"] for m in full}) > 1  # the compared metrics do vary


@pytest.mark.parametrize("lr_schedule", LR_SCHEDULES)
def test_learning_rate_schedules(lr_schedule):
    """transformers' schedules, shifted so that the warmup's first step is not at learning rate
    0: optimizer step s of T (num_iterations per training step) runs at (s + 1) / (w + 1) of
    the learning rate in the warmup's w steps, then at 1, or 1 - p, or (1 + cos(pi p)) / 2 of
    it, p = (s - w) / (T - w). A checkpoint stores the state at the steps taken, and loading
    it continues the schedule where it was."""
    config = GRPOConfig(steps=7, warmup_steps=2, num_iterations=2, lr_schedule=lr_schedule, learning_rate=0.5)
    w, T = 4, 14

    def expected(s):
        if s < w:
            return (s + 1) / (w + 1)
        p = (s - w) / (T - w)
        return {"constant": 1.0, "linear": 1.0 - p, "cosine": 0.5 * (1.0 + math.cos(math.pi * p))}[lr_schedule]

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.learning_rate)
    scheduler = lr_scheduler(optimizer, config.optim, config.rollout)
    for s in range(T):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * expected(s), rel=1e-12, abs=0), s
        optimizer.step()
        scheduler.step()
        if s == 5:
            state = schedule_state(scheduler)
            assert state["last_epoch"] == 6  # optimizer steps taken
    again = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.learning_rate)
    resumed = lr_scheduler(again, config.optim, config.rollout)
    again.param_groups[0]["lr"] = 0.5 * expected(6)  # what the optimizer's own state restores
    load_schedule_state(resumed, state)
    for s in range(6, T):
        assert again.param_groups[0]["lr"] == pytest.approx(0.5 * expected(s), rel=1e-12, abs=0), s
        again.step()
        resumed.step()
    # the same floats as transformers' get_scheduler (which the trainer no longer imports)
    from transformers import get_scheduler

    for warmup, total in ((0, 7), (1, 11), (5, 101), (3, 3)):
        theirs = get_scheduler(
            SCHEDULES[lr_schedule], optimizer, num_warmup_steps=warmup, num_training_steps=total
        ).lr_lambdas[0]
        assert [schedule_factor(lr_schedule, s, warmup, total) for s in range(total + 2)] == [
            theirs(s) for s in range(total + 2)
        ]


def test_a_rank_the_checkpoint_lacks_keeps_its_own_random_state(tmp_path):
    """Resuming on more ranks: rank 0 gets the stored generators, a new rank keeps its own
    (copying rank 0's would make the two draw alike)."""
    trainer = GRPOTrainer(small_config(tmp_path, steps=1, save_every=1))
    trainer.train()
    path = ckpt.latest_checkpoint(trainer.output_dir)
    stored = torch.load(os.path.join(path, "rng-0.pt"), weights_only=False)["torch"]
    for rank in (0, 1):
        torch.manual_seed(1234 + rank)
        before = torch.get_rng_state()
        trainer.runtime.ranks.rank = rank
        ckpt.load_checkpoint(path, trainer.policy, trainer.optimizer, trainer.runtime.ranks)
        assert torch.equal(torch.get_rng_state(), stored if rank == 0 else before), rank
    assert not torch.equal(stored, before)


def test_corrupt_or_foreign_checkpoint_is_a_clear_error(tmp_path):
    """The manifest names a truncated or corrupted file before anything loads; a checkpoint
    without a manifest (written before them) is still checked for its trainer state."""
    trainer = GRPOTrainer(small_config(tmp_path, steps=1))
    trainer.train()
    path = ckpt.checkpoint_path(str(tmp_path / "run"), 1)
    shards = os.path.join(path, "__0_0.distcp")  # the weights and optimizer states
    data = open(shards, "rb").read()
    with open(shards, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(
        ckpt.CheckpointError, match=r"step-000001' is corrupt or incomplete: __0_0.distcp has \d+ bytes.*\(truncated\)"
    ):
        GRPOTrainer(small_config(tmp_path, steps=2)).resume()
    with open(shards, "wb") as f:  # the same size, one byte changed
        f.write(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(
        ckpt.CheckpointError, match="step-000001' is corrupt or incomplete: __0_0.distcp fails its CRC-32 check"
    ):
        GRPOTrainer(small_config(tmp_path, steps=2)).resume()
    os.remove(os.path.join(path, ckpt.MANIFEST))
    with open(shards, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="step-000001.*corrupt or unreadable"):
        GRPOTrainer(small_config(tmp_path, steps=2)).resume()
    torch.save({"step": 1}, os.path.join(path, ckpt.TRAINER_STATE))
    with pytest.raises(ckpt.CheckpointError, match="missing"):
        GRPOTrainer(small_config(tmp_path, steps=2)).resume()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        GRPOTrainer(small_config(tmp_path, output_dir=str(tmp_path / "empty"))).resume()


def test_model_from_a_save_pretrained_folder(tmp_path):
    tokenizer = build_tokenizer()
    saved = build_model(tokenizer, seed=7)
    saved.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    trainer = GRPOTrainer(small_config(tmp_path, model=str(tmp_path / "model"), steps=2))
    for p, q in zip(trainer.policy.parameters(), saved.parameters()):
        assert torch.equal(p, q)
    trainer.train()
    assert len(read_metrics(str(tmp_path / "run"))) == 2


def test_a_hub_model_name_reaches_from_pretrained_unchanged(tmp_path, monkeypatch):
    """``model`` may be a Hub name: it and its revision go to ``from_pretrained`` as given (no
    network here: the loaders are stand-ins that record their arguments); a path-like name
    must be a folder."""
    import transformers

    from grpo_fast.tasks.datasets import is_local_path
    from grpo_fast.trainer import grpo

    calls, checked = [], []
    tokenizer = build_tokenizer()

    def loader(made):
        return classmethod(lambda cls, name, **kwargs: calls.append((cls.__name__, name, kwargs)) or made)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loader(tokenizer))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loader(build_model(tokenizer)))
    monkeypatch.setattr(grpo, "check_model_source", checked.append)
    trainer = GRPOTrainer(small_config(tmp_path, model="org/tiny-model", model_revision="v1"))
    assert [c.model for c in checked] == ["org/tiny-model"]  # reachable before anything loads
    assert [(cls, name, kwargs["revision"]) for cls, name, kwargs in calls] == [
        ("AutoTokenizer", "org/tiny-model", "v1"),
        ("AutoModelForCausalLM", "org/tiny-model", "v1"),
    ]
    assert trainer.tokenizer is tokenizer and "local_files_only" not in calls[1][2]
    assert not is_local_path("Qwen/Qwen2.5-0.5B-Instruct") and not is_local_path("gpt2")
    assert all(is_local_path(p) for p in ("/models/x", "./x", "~/x", "a/b/c", str(tmp_path)))
    with pytest.raises(ValueError, match="model path './no-such-folder' is not a directory"):
        small_config(tmp_path, model="./no-such-folder").validate()


def test_dataset_rows_and_reward_columns(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(4)))
    trainer = GRPOTrainer(
        small_config(tmp_path, dataset=str(path), prompt_column="question", reward_funcs=["arithmetic"], steps=1)
    )
    assert sorted(row["prompt"] for row in trainer.rows) == ["0+0=", "1+1=", "2+2=", "3+3="]
    samples = trainer.source.next(trainer.data_position, trainer.version)
    assert samples.columns["answer"] == [str(2 * int(p[0])) for p in samples.prompts]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(group_size=1), "group_size .* >= 2"),
        (dict(batch_size=10, group_size=4), "batch_size=10 must be divisible by group_size=4"),
        (dict(model="/nonexistent/model"), "model path '/nonexistent/model'"),
        (dict(dataset="/nonexistent/data.jsonl"), "dataset path '/nonexistent/data.jsonl' does not exist"),
        (dict(loss_type="ppo"), "loss_type must be one of"),
        (dict(reward_funcs=["a", "b"], reward_weights=[1.0]), "one weight per entry"),
        (dict(eps_low=1.0), "eps_low must be < 1"),
        (dict(delta=1.0), "delta must be a finite number > 1"),
        (dict(dual_clip=0.9), "dual_clip must be a finite number > 1"),
        (dict(generator="vllm2"), "generator must be one of"),
    ],
)
def test_bad_config_is_a_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig.from_dict(overrides)


def test_unknown_yaml_keys_are_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\nlearning_rte: 0.1\nbetaa: 0\n")
    with pytest.raises(ValueError, match=r"unknown config keys \['betaa', 'learning_rte'\]"):
        GRPOConfig.from_yaml(str(path))
    path.write_text("steps: 3\ngroup_size: 4\nbatch_size: 8\n")
    assert GRPOConfig.from_yaml(str(path), steps=5).steps == 5


def test_dataset_without_the_prompt_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"prompt_column 'prompt'.*question"):
        GRPOTrainer(small_config(tmp_path, dataset=str(path), reward_funcs=["arithmetic"]))


def test_a_raising_reward_stops_the_run_with_its_name(tmp_path):
    def broken_reward(prompts, completions, **columns):
        raise KeyError("answer")

    trainer = GRPOTrainer(small_config(tmp_path), reward_funcs=[broken_reward])
    with pytest.raises(RewardError, match=r"'broken_reward' raised KeyError.*sample 0 \(prompt="):
        trainer.train()


# ---------------------------------------------------------------- seams


def test_every_loss_option_reaches_the_loss(tmp_path, monkeypatch):
    """dual_clip, SAPO's temperatures and the bias-corrected KL are config keys, read by the
    trainer as one LossConfig, and that config is what every loss call of a step gets: its
    values there differ from the default loss's on the same inputs, so the options count."""
    from grpo_fast.trainer.model import packed_policy

    config = small_config(tmp_path, loss_type="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5, kl_bias_correction=True)
    trainer = GRPOTrainer(config)
    assert trainer.loss_config == grpo_fast.LossConfig(
        beta=config.beta,
        loss_type="sapo",
        sapo_tau_pos=2.0,
        sapo_tau_neg=0.5,
        kl_bias_correction=True,
        max_completion_length=config.max_new_tokens,
    )
    calls, policy_loss = [], packed_policy.policy_loss

    def recorded(*args, loss_config, **kwargs):
        out = policy_loss(*args, loss_config=loss_config, **kwargs)
        default = dataclasses.replace(loss_config, loss_type="grpo", kl_bias_correction=False)
        calls.append((loss_config, out.loss.item(), policy_loss(*args, loss_config=default, **kwargs).loss.item()))
        return out

    monkeypatch.setattr(packed_policy, "policy_loss", recorded)
    trainer.train_step()
    assert calls and all(used == trainer.loss_config for used, _, _ in calls)
    assert any(abs(loss - plain) > 1e-6 for _, loss, plain in calls), calls


def test_trainer_leaves_its_callers_state_alone(tmp_path):
    """The caller's tokenizer settings, torch's thread count and matplotlib's backend are
    unchanged by a whole run (train() plots its rewards)."""
    import matplotlib

    tokenizer = build_tokenizer()
    tokenizer.padding_side, tokenizer.truncation_side = "right", "right"
    threads, backend = torch.get_num_threads(), matplotlib.get_backend()
    trainer = GRPOTrainer(small_config(tmp_path, steps=2), model=build_model(tokenizer), tokenizer=tokenizer)
    trainer.train()
    assert (tokenizer.padding_side, tokenizer.truncation_side) == ("right", "right")
    assert torch.get_num_threads() == threads and matplotlib.get_backend() == backend
    assert os.path.isfile(trainer.plot_path)


class ScriptedEngine(Generator):
    """A generation engine for the test below: answers every prompt with its sample index."""

    def __init__(self, model, tokenizer, settings, runtime=None):
        super().__init__(model, tokenizer, settings, runtime)
        self.calls, self.published = [], []

    def publish(self, version):
        self.published.append(version)

    def generate(self, prompts, group_size, keys):
        self.calls.append(list(keys))
        texts = [str(i) for _ in prompts for i in range(group_size)]
        enc = self.tokenizer(
            [p for p in prompts for _ in range(group_size)],
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        ids = torch.tensor([[self.tokenizer.convert_tokens_to_ids(t), self.tokenizer.eos_token_id] for t in texts])
        ones = torch.ones_like(ids)
        input_ids = torch.cat([enc["input_ids"], ids], 1)
        return Generation(input_ids, torch.cat([enc["attention_mask"], ones], 1), ones.float(), texts)


def test_a_generation_engine_is_one_registry_row(tmp_path, monkeypatch):
    """An engine registered in choices.ENGINES is built and used by the trainer, gets each
    prompt's data position as its key, and hears of every optimizer step's weights."""

    monkeypatch.setitem(choices.ENGINES, "scripted", f"{__name__}:ScriptedEngine")
    trainer = GRPOTrainer(small_config(tmp_path, generator="scripted", num_iterations=2))
    engine = trainer.source.engine
    metrics, batch = trainer.run_step()
    assert isinstance(engine, ScriptedEngine) and engine.calls == [[0, 1, 2, 3]] and engine.published == [1, 2]
    assert batch.samples.completions[:4] == ["0", "1", "2", "3"] and metrics["step"] == 1
    assert trainer.train_step()["step"] == 2 and engine.calls[-1] == [4, 5, 6, 7] and engine.published[-1] == 4


def test_dynamic_sampling_keeps_only_groups_with_a_signal(tmp_path, monkeypatch):
    """--dynamic-sampling (DAPO): a group whose rewards are all equal never reaches the loss;
    more prompts are sampled to refill the batch; rounds and dropped groups are logged."""

    def odd_only_reward(prompts, completions, **columns):  # an even first digit: every sample scores 1
        return [1.0 if int(p[0]) % 2 == 0 else float(len(c)) for p, c in zip(prompts, completions)]

    config = small_config(tmp_path, dynamic_sampling=True, max_sampling_rounds=4, generator="sampler", beta=0.1)
    trainer = GRPOTrainer(config, reward_funcs=[odd_only_reward])
    seen, accumulate = [], trainer.accumulate_gradients

    def spy(batch, proximal):
        seen.extend(p for packed in batch.micro_batches for p in batch.samples.prompts[packed.rows])
        return accumulate(batch, proximal)

    monkeypatch.setattr(trainer, "accumulate_gradients", spy)
    metrics = trainer.train_step()
    assert metrics["groups_dropped"] >= 1 and metrics["sampling_rounds"] >= 2
    assert trainer.data_position == 4 * metrics["sampling_rounds"]  # 4 new prompts a round
    assert 0 < len(seen) <= 16 and len(seen) % 4 == 0
    assert all(int(p[0]) % 2 == 1 for p in seen)
    with_signal = 4 * metrics["sampling_rounds"] - metrics["groups_dropped"]
    assert len(seen) // 4 == min(4, with_signal)  # the surplus of the last round is left out


def test_dynamic_sampling_without_any_signal_makes_no_update(tmp_path):
    trainer = GRPOTrainer(
        small_config(tmp_path, dynamic_sampling=True, max_sampling_rounds=2),
        reward_funcs=[lambda prompts, completions, **columns: [1.0] * len(prompts)],
    )
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    metrics = trainer.train_step()
    assert metrics["groups_dropped"] == 8 and metrics["sampling_rounds"] == 2
    assert metrics["loss"] is None and metrics["reward_mean"] is None and metrics["step"] == 1
    assert all(torch.equal(before[name], p) for name, p in trainer.policy.named_parameters())


@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused_linear"])
def test_the_update_reads_the_device_once_per_step(tmp_path, fused_linear):
    """Steady state, rollout aside (it reads every decode step): the update of a step with
    num_iterations = 2 and several micro-batches, its reference-free old log-probs, the
    optimizer steps and the log line read from the device once, all metrics together, and
    each optimizer step reads its non-finite flag (the skip of a NaN step: the fused AdamW's
    found_inf would spare the read, but its rounding breaks the world-size invariance; NOTES)."""
    from grpo_fast.bench.measure import HostReads

    config = small_config(tmp_path, beta=0.1, num_iterations=2, micro_batch_size=5, fused_linear=fused_linear)
    trainer = GRPOTrainer(config)
    batch = next_batch(trainer)
    # the step's samples and batch as they came (sampling reads every decode step, packing the row lengths)
    trainer.source.next = lambda position, version: batch.samples
    trainer.prepare = lambda samples: batch
    trainer.train_step()  # first step: lazy initialisation (optimizer state)
    with HostReads() as reads:
        metrics = trainer.train_step()
    assert len(batch.micro_batches) > 2 and metrics["entropy"] is not None
    assert reads.count == 1 + config.num_iterations, reads.calls
