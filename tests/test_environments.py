"""Environments (grpo_fast/environments, the turn loop of trainer/rollout/turns.py): the protocol's
checks, a fresh environment per episode, faults that end only their episode, TRL's
environment_factory classes unchanged, token-in/token-out suffixes out of the loss, and the
float64 reference on a batch with environment turns.

The model is the tool task's tiny Llama with its tokenizer (a ChatML template), built once and
not warm-started: these tests are about the loop, not about what the model learns. A scripted
environment answers "no" until the model says "7", or its turn budget runs out.
"""

import asyncio
import dataclasses
import json
import time

import pytest
import torch
from conftest import completion_logits, completion_logprobs, max_err, rel_err, write_jsonl

from grpo_fast import reference
from grpo_fast.environments import Environment, EnvironmentFactory, EnvStep, TRLEnvironment
from grpo_fast.spec import LossConfig
from grpo_fast.tasks import tool_arithmetic
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.model.build import reference_context
from grpo_fast.trainer.rollout import turns
from grpo_fast.trainer.rollout.turns import turn_loop
from grpo_fast.trainer.run.run_log import read_completions, read_metrics

ROWS = [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in ((347, 28), (120, 11), (999, 99), (500, 50))]
OPTIONS = dict(batch_size=8, group_size=4, max_new_tokens=16, max_turns=3, progress=False, save_every=0)


@pytest.fixture(scope="module")
def tokenizer():
    return tool_arithmetic.build_tokenizer()


def ending_turns(model, tokenizer):
    """``model`` with a fixed LM-head bias of 6 on its end of turn (about one token in four ends
    a turn): an untrained model's turns end, so that episodes take several."""
    bias = torch.zeros(model.config.vocab_size, dtype=model.dtype)
    bias[tokenizer.eos_token_id] = 6.0
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return model


@pytest.fixture
def model(tokenizer):
    return ending_turns(tool_arithmetic.build_model(tokenizer, seed=1), tokenizer)


class NotSeven(Environment):
    """Answers "no" until the model says 7 (reward 1, done); counts its instances and steps."""

    made = 0

    def __init__(self):
        type(self).made += 1
        self.steps, self.row = 0, None

    def reset(self, row):
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.steps += 1
        if message["content"].strip() == "7":
            return EnvStep([], True, 1.0)
        return EnvStep([{"role": "user", "content": "no"}], False, 0.0)


def trainer_in(tmp_path, model, tokenizer, environment, **overrides) -> GRPOTrainer:
    config = GRPOConfig(**{**OPTIONS, "output_dir": str(tmp_path / "run"), **overrides})
    return GRPOTrainer(config, model=model, tokenizer=tokenizer, rows=list(ROWS), environment=environment)


def test_episodes_get_fresh_environments_and_their_turns_are_out_of_the_loss(tmp_path, model, tokenizer, monkeypatch):
    """Two steps: each episode has its own environment (made per episode, never reused across
    groups or steps), which saw every turn of its episode; each observation is appended as the
    chat template's suffix (token in, token out: the sampled tokens as they are, the suffixes the
    template's), with completion_mask 0 on it and 1 on the sampled tokens; the log line has the
    env/* metrics, and completions.jsonl each turn with its role."""
    seen = []

    class Kept(turns.Episodes):
        def __init__(self, *args):
            super().__init__(*args)
            seen.append(self)

    monkeypatch.setattr(turns, "Episodes", Kept)
    trainer = trainer_in(tmp_path, model, tokenizer, NotSeven, steps=2, log_completions_every=1)
    made = NotSeven.made
    history = trainer.train()
    envs = [env for episodes in seen for env in episodes.envs]
    assert len(envs) == 16 and len({id(env) for env in envs}) == 16 and NotSeven.made - made == 16
    for m in history:
        assert 1 <= m["env/turns_mean"] <= 3 and m["env/errors"] == 0 and 0 <= m["env/success"] <= 1
        assert {"env/seconds", "rewards/environment_reward"} <= set(m)
    for episodes in seen:
        for env, messages in zip(episodes.envs, episodes.messages):
            assert env.steps == sum(m["role"] == "assistant" for m in messages) <= 3
            assert env.row["prompt"] in {row["prompt"] for row in ROWS}
    # a third batch, token by token
    samples = trainer.source.next(trainer.data_position, trainer.version)
    C, episodes, template = samples.completion_mask.shape[1], seen[-1], trainer.turn_loop.template
    observed = 0
    for row in range(len(samples.prompts)):
        real = samples.attention_mask[row, -C:].bool()
        ids, sampled = samples.input_ids[row, -C:][real].tolist(), samples.completion_mask[row][real].bool().tolist()
        runs = _runs(ids, sampled)
        observations = [m for m in episodes.messages[row] if m["role"] == "user"]
        turns_ = [ids for ids, is_sampled in runs if is_sampled]
        suffixes = [ids for ids, is_sampled in runs if not is_sampled]
        assert len(suffixes) == len(observations) and len(turns_) == len(suffixes) + 1
        for turn, suffix, observation in zip(turns_, suffixes, observations):
            assert suffix == template.suffix_ids([observation], completion_ids=turn)
        observed += len(observations)
    assert observed > 0
    rows = read_completions(str(tmp_path / "run"))
    roles = [m["role"] for row in rows for m in row["completion"]]
    assert "user" in roles and rows[0]["completion"][-1]["role"] == "assistant"


def _runs(ids: list, flags: list) -> list:
    """``ids`` cut into runs of equal ``flags``: [(ids, flag)]."""
    out = []
    for token, flag in zip(ids, flags):
        if out and out[-1][1] == flag:
            out[-1][0].append(token)
        else:
            out.append(([token], flag))
    return out


class Faulty(Environment):
    """Episode by row: 120*11 raises in step, 999*99 sleeps past the timeout, 500*50 floods."""

    def reset(self, row):
        self.prompt = row["prompt"]
        return row["prompt"]

    def step(self, message):
        if self.prompt == "120*11":
            raise RuntimeError("the game server is down")
        if self.prompt == "999*99":
            time.sleep(3)
        if self.prompt == "500*50":
            return "x" * 5000, False, 0.5
        return [{"role": "user", "content": "no"}], False, 0.25


def test_errors_timeouts_and_floods_end_only_their_episode(tmp_path, model, tokenizer, caplog):
    """An environment that raises or outlives environment_timeout_s ends its episode with reward 0,
    counted in env/errors and logged; a flooding one is cut (max_tool_response_tokens) or, with no
    room left, ends its episode; the others go on (their rewards add up step by step)."""
    trainer = trainer_in(
        tmp_path,
        model,
        tokenizer,
        Faulty,
        batch_size=16,
        max_new_tokens=48,
        environment_timeout_s=1.0,
        max_tool_response_tokens=8,
    )
    rows = ROWS
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="grpo_fast"):
        samples = trainer.source.next(0, 0)  # the first 4 rows in data order, 4 episodes each
    assert time.perf_counter() - start < 30
    order = [samples.prompts[i].split("user\n")[1].split("<")[0] for i in range(0, 16, 4)]
    rewards = samples.rewards[:, 0].view(4, 4)
    counts = samples.env_counts.view(4, 4, 4)  # turns, errors, successes, scored
    for g, prompt in enumerate(order):
        errors = counts[g, :, 1]
        if prompt in ("120*11", "999*99"):
            assert (errors == 1).all() and (rewards[g] == 0).all()
        else:
            assert (errors == 0).all() and (rewards[g] > 0).all()
    assert "the game server is down" in caplog.text and "Faulty.step timed out after 1s" in caplog.text
    assert "8 environment episode(s) ended with reward 0" in caplog.text  # one line for a batch's failures
    assert "down (4x)" in caplog.text
    assert {r["prompt"] for r in rows} == set(order)
    flood = order.index("500*50")
    user = [m["content"] for row in range(4 * flood, 4 * flood + 4) for m in samples.completions[row][1:-1]]
    assert user and all("tokens cut ..." in text and "x" * 100 not in text for text in user)  # cut in the middle


class Drifting(Environment):
    """Starts every episode differently: out of protocol for GRPO's groups."""

    count = 0

    def reset(self, row):
        type(self).count += 1
        return f"{row['prompt']} ({self.count})"

    def step(self, message):
        return EnvStep([], True, 0.0)


class Misbehaving(Environment):
    def step(self, message):
        return {"observations": []}


def test_protocol_violations_are_named(tmp_path, model, tokenizer, caplog):
    """A group's episodes that start differently are a ValueError naming the environment; a step
    that answers out of protocol ends its episode as an error (TypeError text in the log); a class
    without reset, or an Environment without step, is refused when the factory is made."""
    with pytest.raises(ValueError, match="environment Drifting: the episodes of one row started from different"):
        trainer_in(tmp_path, model, tokenizer, Drifting).train_step()
    trainer = trainer_in(tmp_path / "b", model, tokenizer, Misbehaving)
    with caplog.at_level("WARNING", logger="grpo_fast"):
        metrics = trainer.train_step()
    assert metrics["env/errors"] == 8 and "Misbehaving.step must return an EnvStep" in caplog.text

    class NoReset:
        pass

    class NoStep(Environment):
        pass

    with pytest.raises(TypeError, match="needs a reset method"):
        EnvironmentFactory(NoReset)
    with pytest.raises(TypeError, match="must implement step"):
        EnvironmentFactory(NoStep)
    with pytest.raises(ValueError, match="a dict of factories"):
        EnvironmentFactory({"a": NotSeven})
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        GRPOConfig(environment="nope").validate()
    for value, match in (
        ((None, False), "no observation for an episode that goes on"),
        (("ok", "yes"), "done='yes'"),
        (("ok", False, "1"), "reward='1'"),
        (([{"role": "user"}], False), "messages"),
    ):
        with pytest.raises(TypeError, match=match):
            EnvStep.of(value, "X.step")


class AsyncSeven(NotSeven):
    """NotSeven with async methods: the loop awaits them on its event loop, concurrently."""

    running = 0
    most = 0

    async def reset(self, row):
        return super().reset(row)

    async def step(self, message):
        cls = type(self)
        cls.running += 1
        cls.most = max(cls.most, cls.running)
        await asyncio.sleep(0.05)
        cls.running -= 1
        return super().step(message)


def test_async_environments_step_concurrently(tmp_path, model, tokenizer):
    metrics = trainer_in(tmp_path, model, tokenizer, AsyncSeven).train_step()
    assert metrics["env/errors"] == 0 and AsyncSeven.most > 1


def test_the_hf_engine_runs_episodes(tmp_path, model, tokenizer):
    """generator='hf' continues each episode from its token ids after the observations."""
    metrics = trainer_in(tmp_path, model, tokenizer, NotSeven, generator="hf").train_step()
    assert metrics["env/turns_mean"] > 1 and metrics["env/errors"] == 0


class GuessGame:
    """A TRL environment_factory class, as TRL's docs write them: reset(**row), one tool."""

    def __init__(self):
        self.target, self.guesses, self.solved = None, 0, False

    def reset(self, target: int = 7, **kwargs) -> str | None:
        self.target, self.guesses, self.solved = int(target), 0, False
        return " Use the guess tool."

    def guess(self, number: int) -> str:
        """
        Guess the hidden number.

        Args:
            number: The integer you think is hidden.
        """
        self.guesses += 1
        self.solved = number == self.target
        return "correct" if self.solved else ("too low" if number < self.target else "too high")

    def get_reward(self) -> float:
        return float(self.solved)

    def _helper(self):
        pass


def test_a_trl_environment_class_runs_unchanged(tmp_path, model, tokenizer):
    """TRL's shape: reset(**row) appends its text to the prompt; its public methods are the tools
    (not reset, get_reward or _helper), each episode's bound to its own instance; a turn's call of
    the tool is answered by that instance; get_reward scores the episode (environment_reward), and
    reward functions read the instances as ``environments=``."""
    factory = EnvironmentFactory(GuessGame)
    assert factory.trl and factory.scores and [t.name for t in factory.tools] == ["guess"]
    env = factory()
    assert isinstance(env, TRLEnvironment)
    messages = env.reset({"prompt": "Find it.", "target": 3})
    assert messages == [{"role": "user", "content": "Find it. Use the guess tool."}]
    tools = factory.episode_tools(env)
    assert tools["guess"].function(number=3) == "correct" and env.step({"content": ""}) == ([], True, 1.0)
    other = factory()
    other.reset({"prompt": "Find it.", "target": 5})
    assert factory.episode_tools(other)["guess"].function(number=3) == "too low" and env.env.guesses == 1

    seen = {}

    def read_environments(prompts, completions, environments, **columns):
        seen["environments"] = environments
        return [float(e.guesses) for e in environments]

    rows = [dict(row, target=i) for i, row in enumerate(ROWS)]
    config = GRPOConfig(**{**OPTIONS, "output_dir": str(tmp_path / "run")})
    trainer = GRPOTrainer(
        config,
        model=model,
        tokenizer=tokenizer,
        rows=rows,
        environment=GuessGame,
        reward_funcs=[read_environments, "environment_reward"],
    )
    assert trainer.turn_loop.template.tools[0].name == "guess"
    assert "guess" in trainer.source.next(0, 0).prompts[0]  # the prompt shows the tool
    metrics = trainer.train_step()
    assert all(isinstance(e, GuessGame) for e in seen["environments"]) and len(seen["environments"]) == 8
    assert {"rewards/read_environments", "rewards/environment_reward", "tools/call_frequency"} <= set(metrics)


def test_the_environment_resumes_exactly_and_runs_in_the_rollout_worker(tmp_path, model, tokenizer):
    """A run cut after step 1 and resumed logs step 2 as the run left alone (the environments are
    made anew: nothing of theirs is in a checkpoint); the asynchronous worker (max_staleness 1)
    makes the environment from its name and logs the same env/* keys."""
    import shutil

    from conftest import without_timings

    from grpo_fast.trainer.run import checkpoint as ckpt

    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = "test_environments:NotSeven"
    whole = trainer_in(tmp_path / "full", model, tokenizer, name, steps=2, save_every=1).train()
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(ckpt.checkpoint_path(str(tmp_path / "cut" / "run"), 2))
    model.load_state_dict(state)
    cut = trainer_in(tmp_path / "cut", model, tokenizer, name, steps=2, save_every=1)
    assert cut.resume(auto=True) == 1
    assert without_timings(cut.train()[1:]) == without_timings(whole[1:])
    model.load_state_dict(state)
    worker = trainer_in(tmp_path / "async", model, tokenizer, name, max_staleness=1)
    try:
        metrics = worker.train_step()
    finally:
        worker.close()
    assert {"env/turns_mean", "env/errors", "env/success", "env/seconds"} <= set(metrics)


@pytest.mark.usefixtures("float64_norms")  # Llama's norm in float64 (tests/_float64.py)
def test_loss_and_gradients_with_environment_turns_equal_the_float64_reference(tmp_path, tokenizer):
    """A batch sampled in the environment (turns, "no" observations) through the trainer's own
    stages, float64, a KL term against a moved reference: loss, KL and every gradient equal the
    reference on the padded batch with the completion mask 0 on the observations."""
    model = ending_turns(tool_arithmetic.build_model(tokenizer, seed=2), tokenizer).double()
    trainer = trainer_in(tmp_path, model, tokenizer, NotSeven, beta=0.1, max_tokens_per_micro_batch=60)
    with torch.no_grad():
        for p in trainer.reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    samples = trainer.source.next(0, 0)
    batch = trainer.prepare(samples)
    mask = batch.completion_mask
    C = mask.shape[1]
    observed = samples.attention_mask[:, -C:].bool() & ~mask.bool()
    assert observed.sum() > 0 and len(batch.micro_batches) > 1
    batch.advantages = torch.randn(len(mask), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result = trainer.accumulate_gradients(batch, None)
    grads = torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.requires_grad])
    trainer.optimizer.zero_grad(set_to_none=True)
    with reference_context(trainer.policy, trainer.reference):
        ref = completion_logprobs(trainer.reference, samples.input_ids, samples.attention_mask, C)
    logits = completion_logits(trainer.policy, samples.input_ids, samples.attention_mask, C)
    config = trainer.loss_config
    out = reference.grpo_loss(
        logits,
        samples.input_ids[:, -C:],
        batch.advantages,
        mask,
        None,
        ref,
        num_items_in_batch=mask.sum(),
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(LossConfig)},
    )
    out.loss.backward()
    expected = torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.requires_grad])
    assert expected.norm() > 0 and out.kl > 0
    assert rel_err(grads, expected) < 1e-10 and max_err(grads, expected) < 1e-10
    assert result.metrics["loss"].item() == pytest.approx(out.loss.item(), rel=1e-10, abs=1e-12)


def test_turn_loop_needs_a_chat_template(model):
    from grpo_fast.tasks.arithmetic import build_tokenizer

    with pytest.raises(ValueError, match="has no chat_template"):
        turn_loop(build_tokenizer(), [], EnvironmentFactory(NotSeven), GRPOConfig())


def test_cli_eval_runs_an_environment(tmp_path, model, tokenizer):
    """``grpo-fast eval --environment ...`` on a saved model: the episodes' rewards as eval/*."""
    from grpo_fast.cli import main

    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "eval.json"
    args = ["eval", "--model", str(folder), "--dataset", str(data), "--environment", "test_environments:NotSeven"]
    assert main([*args, "--max-turns", "2", "--max-new-tokens", "12", "-n", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "eval/pass@1" in result["metrics"] and result["metrics"]["eval/reward_mean"] is not None


@pytest.mark.slow
def test_torchrun_runs_the_environment_as_one_process(tmp_path, model, tokenizer):
    """``torchrun --nproc-per-node 2 -m grpo_fast train --environment ...`` (the tool task's
    tokenizer and an untrained model, saved, whose turns seldom end before the budget: the
    multi-turn mechanics are the other tests'): each rank runs its share of the episodes, and the
    log lines, env/* counts summed over ranks, equal one process's run to 1e-4."""
    from conftest import assert_rows_close, one_thread, start_child, torchrun_command

    from grpo_fast.cli import main

    folder = str(tmp_path / "model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS * 2)
    train = ["train", "--model", folder, "--dataset", str(data), "--environment", "test_environments:NotSeven"]
    train += ["--max-turns", "3", "--steps", "2", "--batch-size", "16", "-G", "4", "--max-new-tokens", "12"]
    train += ["--no-progress", "--save-every", "0"]
    with start_child(torchrun_command("-m", "grpo_fast", *train, "--output", str(tmp_path / "two"))) as job:
        assert one_thread(lambda: main([*train, "--output", str(tmp_path / "one")])) == 0
    assert job.returncode == 0, job.stderr[-3000:]
    two, one = read_metrics(str(tmp_path / "two")), read_metrics(str(tmp_path / "one"))
    assert all(m["env/turns_mean"] >= 1 and m["env/errors"] == 0 for m in two)
    assert_rows_close(two, one, rel=1e-4)
