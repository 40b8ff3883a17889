"""Multi-turn rollouts, the engine's side: a turn ends at EOS or a stop token, the rows wait for
each other, the turn handler's suffix is appended and sampling goes on; the sampler continues
from its KV cache. Scripted turns (every turn answered by a fixed suffix) make it testable with a
random tiny model; the tool loop over real tools is tested with the tool task."""

import pytest
import torch
from _turns import ScriptedTurns

from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator, position_ids


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = build_tokenizer()
    return build_model(tokenizer, seed=3), tokenizer


def full_forward_logprobs(model, out) -> torch.Tensor:
    """[N, C] log-probs of each completion token under one forward over the whole sequences
    (prompt, turns and suffixes, as the trainer's forward sees them)."""
    C = out.completion_mask.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out.input_ids, attention_mask=out.attention_mask, position_ids=position_ids(out.attention_mask)
        ).logits
    logp = torch.log_softmax(logits[:, -C - 1 : -1].float(), -1)
    return logp.gather(-1, out.input_ids[:, -C:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("engine", ["sampler", "hf"])
def test_turns_continue_with_the_suffix(model_and_tokenizer, engine):
    """With a stop token that a random model samples often (a digit), rows end turns at
    different steps, wait, get the suffix, and go on: the suffix sits right after the turn's
    stop token, under the attention mask but out of the completion mask; every row respects
    the budget; the sampler's log-probs of its sampled tokens are those of one forward over the
    final sequences (the KV cache across turns, masked waiting slots included, holds exactly
    the context), and 0 on the suffix."""
    model, tokenizer = model_and_tokenizer
    config = GRPOConfig(max_new_tokens=14, batch_size=8, group_size=4, seed=1, generator=engine)
    stop, suffix = tokenizer.convert_tokens_to_ids("7"), tokenizer.encode("+=+", add_special_tokens=False)
    turns = ScriptedTurns(stop, suffix)
    torch.manual_seed(0)
    out = make_generator(engine, model, tokenizer, EngineSettings.of(config)).generate(
        ["1+2=", "34+5="], 4, [0, 1], turns=turns
    )
    C = out.completion_mask.shape[1]
    completion, real, sampled = out.input_ids[:, -C:], out.attention_mask[:, -C:].bool(), out.completion_mask.bool()
    assert C <= config.max_new_tokens and bool((sampled <= real).all())
    eos = tokenizer.eos_token_id
    answered = 0
    for row in range(8):
        ids, is_sampled = completion[row][real[row]].tolist(), sampled[row][real[row]].tolist()
        assert len(ids) <= config.max_new_tokens
        i = 0
        while i < len(ids):  # walk the row: sampled turns, each answered turn followed by the suffix
            assert is_sampled[i]
            if ids[i] in (stop, eos) and i + 1 < len(ids):
                assert ids[i + 1 : i + 1 + len(suffix)] == suffix and not any(is_sampled[i + 1 : i + 1 + len(suffix)])
                answered += 1
                i += len(suffix)
            i += 1
    assert answered == sum(turns.answered.values()) and answered > 0, "no row was continued: pick another stop"
    assert all(turn[-1] in (stop, eos) for _, turn, _ in turns.seen)  # handed only ended turns
    if engine == "sampler":
        expected = full_forward_logprobs(model, out)
        torch.testing.assert_close(out.logprobs[sampled], expected[sampled], atol=1e-5, rtol=1e-5)
        assert bool((out.logprobs[~sampled] == 0).all())
    else:
        assert out.logprobs is None


def test_without_turns_the_sampler_is_unchanged(model_and_tokenizer):
    """The single-turn path through the same loop: a turn handler that never answers gives the
    rows of a run without one (turns end at EOS, nothing appended)."""
    model, tokenizer = model_and_tokenizer
    config = GRPOConfig(max_new_tokens=6, batch_size=8, group_size=4, seed=2)
    engine = make_generator("sampler", model, tokenizer, EngineSettings.of(config))
    plain = engine.generate(["1+2=", "3+4="], 4, [5, 6])
    never = engine.generate(["1+2=", "3+4="], 4, [5, 6], turns=ScriptedTurns(tokenizer.eos_token_id, [1], turns=0))
    C = plain.completion_mask.shape[1]
    assert torch.equal(plain.input_ids, never.input_ids[:, : plain.input_ids.shape[1]]) or C == 0
    torch.testing.assert_close(plain.completion_mask, never.completion_mask[:, :C])
    torch.testing.assert_close(plain.logprobs, never.logprobs[:, :C])


# ---------------------------------------------------------------- the trainer with tools

TOOL_RUN = dict(task="tool_arithmetic", tools=["calculator"], batch_size=16, group_size=4, progress=False)


@pytest.fixture
def short_warm_start(monkeypatch):
    """The tool task's warm start cut to 30 steps: these tests check the machinery, not learning."""
    import functools

    from grpo_fast.tasks import tool_arithmetic

    monkeypatch.setattr(tool_arithmetic, "warm_start", functools.partial(tool_arithmetic.warm_start, steps=30))


def test_a_tool_run_logs_its_turns_and_resumes_after_preemption_exactly(tmp_path, short_warm_start):
    """The tool task with the calculator: the log line has TRL's tools/* metrics,
    completions.jsonl each turn with its role, and a run preempted by SIGTERM in step 3 (no
    periodic checkpoint at 3) saves step 3 and, resumed with ``resume(auto=True)``, ends with the
    uninterrupted run's metrics (timings aside) and weights, bit for bit."""
    from conftest import same_weights, signal_in_step, without_timings

    from grpo_fast.trainer import GRPOTrainer
    from grpo_fast.trainer.run import faults
    from grpo_fast.trainer.run.run_log import read_completions, read_metrics

    def config(name):
        return GRPOConfig.from_dict(dict(TOOL_RUN, steps=4, save_every=2, output_dir=str(tmp_path / name)))

    whole = GRPOTrainer(config("full"))
    whole.train()
    full = read_metrics(str(tmp_path / "full"))
    assert all(0 < m["tools/call_frequency"] and m["tools/turns_mean"] >= 1 for m in full)
    assert {"tools/failure_frequency", "tools/seconds"} <= set(full[0])
    trajectory = read_completions(str(tmp_path / "full"))[0]["completion"]
    assert [m["role"] for m in trajectory][-1] == "assistant" and {"role", "content"} <= set(trajectory[0])
    assert any(m["role"] == "tool" for row in read_completions(str(tmp_path / "full")) for m in row["completion"])

    cut = GRPOTrainer(config("cut"))
    signal_in_step(cut, 3)
    with pytest.raises(faults.Preempted) as stop:
        cut.train()
    assert stop.value.step == 3 and len(read_metrics(str(tmp_path / "cut"))) == 3
    resumed = GRPOTrainer(config("cut"))
    assert resumed.resume(auto=True) == 3
    resumed.train()
    assert without_timings(read_metrics(str(tmp_path / "cut"))) == without_timings(full)
    assert same_weights(resumed, whole)


def test_tools_run_in_the_rollout_worker(tmp_path, short_warm_start):
    """max_staleness 1: the worker runs the tool loop (its own template, the resolved tools)."""
    from grpo_fast.trainer import GRPOTrainer

    config = GRPOConfig.from_dict(dict(TOOL_RUN, steps=3, max_staleness=1, output_dir=str(tmp_path / "run")))
    trainer = GRPOTrainer(config)
    history = trainer.train()
    assert len(history) == 3 and all(m["tools/call_frequency"] > 0 for m in history)
    assert all("tools/seconds" in m for m in history)


def test_bad_tools_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    """A tool that is not a function, one without a schema, a template that does not render
    tools: ValueError/TypeError naming it, and the model never loads."""
    from grpo_fast.trainer import GRPOTrainer, grpo

    def untyped(x):
        """No type hint."""
        return x

    config = GRPOConfig.from_dict(dict(TOOL_RUN, steps=1, output_dir=str(tmp_path / "run")))
    monkeypatch.setattr(grpo, "check_model_source", lambda config: None)
    with pytest.raises(TypeError, match="tools: each entry must be a built-in tool name or a function"):
        GRPOTrainer(config, tools=[42])
    with pytest.raises(ValueError, match="cannot build the JSON schema of tool 'untyped'"):
        GRPOTrainer(config, tools=[untyped])
    demo = GRPOConfig.from_dict(dict(TOOL_RUN, task=None, steps=1, output_dir=str(tmp_path / "run")))
    with pytest.raises(ValueError, match="chat_template"):
        GRPOTrainer(demo)


def test_rewards_see_trajectories_and_tool_counts(tmp_path, short_warm_start):
    """A reward function gets each completion as its messages (TRL's shape) and the columns
    tool_calls and tool_failures, the rows' counts that the log line's tools/* come from."""
    from grpo_fast.trainer import GRPOTrainer
    from grpo_fast.trainer.rollout.samples import rollout

    seen = {}

    def probe(prompts, completions, tool_calls, tool_failures, **columns):
        seen.update(completions=completions, tool_calls=tool_calls, tool_failures=tool_failures)
        return [float(n) for n in tool_calls]

    trainer = GRPOTrainer(GRPOConfig.from_dict(dict(TOOL_RUN, steps=1, output_dir=str(tmp_path / "run"))))
    rows = trainer.rows[:2]
    samples = rollout(trainer.source.engine, rows, [0, 1], [probe], group_size=4, turns=trainer.turn_loop)
    assert all(isinstance(c, list) and c[-1]["role"] == "assistant" for c in seen["completions"])
    calls = [sum(len(m.get("tool_calls", [])) for m in c if m["role"] == "assistant") for c in seen["completions"]]
    tool_messages = [sum(m["role"] == "tool" for m in c) for c in seen["completions"]]
    assert seen["tool_calls"] == tool_messages == samples.tool_counts[:, 0].long().tolist()
    assert all(c >= t for c, t in zip(calls, tool_messages))  # a last turn's calls are not run
    assert sum(seen["tool_calls"]) > 0
    assert seen["tool_failures"] == samples.tool_counts[:, 1].long().tolist()
    assert samples.rewards[:, 0].tolist() == [float(n) for n in seen["tool_calls"]]


def test_a_task_brings_its_own_defaults():
    """TASK_SETTINGS: the tool task's max_new_tokens replaces the config's default, however the
    config is made; a value given is kept."""
    assert GRPOConfig(task="tool_arithmetic").max_new_tokens == 32
    assert GRPOConfig.from_dict(dict(task="tool_arithmetic")).max_new_tokens == 32
    assert GRPOConfig(task="tool_arithmetic", max_new_tokens=40).max_new_tokens == 40
    assert GRPOConfig().max_new_tokens == 4


def test_each_row_turns_within_its_own_budget(model_and_tokenizer):
    """continue_turns (hf, vllm) gives every row its own room: a row whose suffix left it more
    room than another's is not cut to the smaller one."""
    from grpo_fast.trainer.rollout.engines import continue_turns

    _, tokenizer = model_and_tokenizer
    eos, T = tokenizer.eos_token_id, 12
    asked = []

    def sample(rows, sequences, rooms, stop_ids):  # each row writes 3 tokens then stops, or fills its room
        asked.append(dict(zip(rows, rooms)))
        return [([5] * min(3, room - 1) + [eos] if len(asked) == 1 else [6] * room, None) for room in rooms]

    class Turns(ScriptedTurns):
        def suffixes(self, rows, turns, room):  # row 0 gets a long suffix, row 1 a short one
            return [[7] * 5 if row == 0 else [7] for row in rows]

    prompt_ids = torch.tensor([[1, 2], [1, 2]])
    out = continue_turns(sample, tokenizer, prompt_ids, torch.ones_like(prompt_ids), Turns(eos, []), T)
    assert asked[1] == {0: 12 - 4 - 5, 1: 12 - 4 - 1}
    lengths = out.attention_mask[:, 2:].sum(1).tolist()
    assert lengths == [T, T] and out.completion_mask.sum(1).tolist() == [4 + 3, 4 + 7]
