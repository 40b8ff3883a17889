"""The verifiers 0.4 adapter (grpo_fast.environments.verifiers), offline, on the toy taskset
``_vf_toy`` (tests/_vf_toy.py: sums with a stateful calculator, a stop hook after two calls, a
rubric of two weighted rewards). Episodes are driven through our turn loop with scripted turns
(the tool call and the answers as the tool task's chat template renders them), then one
training step runs with ``environment="verifiers:_vf_toy"``."""

import pickle
import sys

import pytest

from grpo_fast.environments import EnvironmentFactory
from grpo_fast.environments.verifiers import VerifiersEnvironment, taskset_of, verifiers_factory, verifiers_rows
from grpo_fast.tasks import tool_arithmetic
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.rollout.turns import turn_loop

vf = pytest.importorskip("verifiers.v1", reason="the verifiers extra: pip install 'grpo-fast[verifiers]'")
import _vf_toy  # noqa: E402  (tests/ is on sys.path: verifiers imports the taskset id "_vf_toy" as this module)

CALL = '<tool_call>{"name": "calculator_add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'
OPTIONS = dict(batch_size=4, group_size=2, max_new_tokens=48, max_turns=4, progress=False, save_every=0)


@pytest.fixture(scope="module")
def tokenizer():
    return tool_arithmetic.build_tokenizer()


@pytest.fixture(scope="module")
def factory():
    """The factory of a Taskset object, as a Python user passes one."""
    return EnvironmentFactory(_vf_toy.ToyTaskset(vf.TasksetConfig()))


def run_episodes(factory, tokenizer, row: dict, scripts: list) -> tuple:
    """Runs one episode per script of ``scripts`` (each a list of turn texts) on ``row`` through
    the turn loop, as an engine drives it; returns ``(episodes, each episode's suffixes)``."""
    config = GRPOConfig(**OPTIONS)
    episodes = turn_loop(tokenizer, [], factory, config)([row], len(scripts))
    completions, suffixes = [[] for _ in scripts], [[] for _ in scripts]
    going = list(range(len(scripts)))
    for turn in range(max(map(len, scripts))):
        rows = [r for r in going if turn < len(scripts[r])]
        turns = [tokenizer.encode(scripts[r][turn], add_special_tokens=False) for r in rows]
        room = [1000] * len(rows)  # the scripts' own length bounds them
        going = []
        for r, ids, suffix in zip(rows, turns, episodes.suffixes(rows, turns, room)):
            completions[r] += ids + (suffix or [])
            suffixes[r].append(suffix)
            going += [r] if suffix is not None else []
    episodes.trajectories(completions)
    return episodes, suffixes


def test_rows_and_reset_give_each_task_its_system_prompt_and_prompt(factory, tokenizer):
    """A row per task, its prompt the system prompt then the prompt; every episode of a row
    starts alike; the tools are the toolset's, named and described as verifiers shows them; the
    factory pickles (a rollout worker gets it) and works as the original."""
    rows = verifiers_rows("verifiers:_vf_toy")
    assert [row["prompt"] for row in rows] == [
        [{"role": "system", "content": "Add with the calculator."}, {"role": "user", "content": p}]
        for p in ("2+3", "10+7", "40+2")
    ]
    assert [row["verifiers_task"]["answer"] for row in rows] == ["5", "17", "42"]
    assert [tool.name for tool in factory.tools] == ["calculator_add"]
    function = factory.tools[0].schema["function"]
    assert function["description"] == "Add two integers." and function["parameters"]["required"] == ["a", "b"]
    copy = EnvironmentFactory(pickle.loads(pickle.dumps(factory.spec)))
    for made in (factory, copy):
        episodes = turn_loop(tokenizer, [], made, GRPOConfig(**OPTIONS))(rows[1:2], 2)  # raises unless alike
        assert all(isinstance(env, VerifiersEnvironment) for env in episodes.envs)
        assert episodes.prompts == [episodes.template.prompt_text(rows[1]["prompt"])]


def test_a_tool_call_is_answered_by_the_taskset_tool_and_the_rubric_is_the_reward(factory, tokenizer):
    """Through the turn loop: a turn calling calculator_add is answered by the toy's tool (its
    result in the template's suffix, its State in the trace), the answer after it ends the
    episode, and the rubric's weighted sum is its environment_reward (1 + 0.5); a wrong answer
    without the tool scores 0, and reward functions read the traces."""
    row = verifiers_rows("_vf_toy")[0]
    episodes, suffixes = run_episodes(factory, tokenizer, row, [[CALL, "5<|im_end|>"], ["7<|im_end|>"]])
    assert "<tool_response>5</tool_response>" in tokenizer.decode(suffixes[0][0]) and suffixes[0][1:] == [None]
    assert suffixes[1] == [None]
    columns = episodes.columns()
    assert columns["environment_reward"] == [1.5, 0.0]
    right, wrong = columns["environments"]
    assert {name: r.score for name, r in right.rewards.items()} == {"correct": 1.0, "used_calculator": 1.0}
    assert right.state.calls == 1 and right.metrics == {"turns": 2.0} and right.stop_condition is None
    assert [m.role for m in right.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert right.messages[2].tool_calls[0].name == "calculator_add" and right.messages[3].content == "5"
    assert wrong.rewards["correct"].score == 0.0 and wrong.state.calls == 0
    assert [m["role"] for m in episodes.messages[0]] == ["assistant", "tool", "assistant"]


def test_a_stop_hook_ends_the_episode_where_verifiers_would(factory, tokenizer):
    """The toy's stop hook fires after the second call: verifiers would make no further model
    call, so the third call is refused and the final answer is outside the scored trace (the
    right sum after the stop earns nothing: 0.5 for the calculator alone)."""
    row = verifiers_rows("_vf_toy")[0]
    script = [CALL, CALL, CALL, "5<|im_end|>"]
    episodes, suffixes = run_episodes(factory, tokenizer, row, [script])
    assert "the episode is over (out_of_calls)" in tokenizer.decode(suffixes[0][2])
    trace = episodes.columns()["environments"][0]
    assert trace.stop_condition == "out_of_calls" and trace.state.calls == 2 and trace.num_turns == 2
    assert episodes.columns()["environment_reward"] == [0.5] and episodes.failures == [1]


def test_a_training_step_on_a_verifiers_environment(tmp_path, tokenizer):
    """``environment="verifiers:_vf_toy"`` in the config: the rows are its tasks, the prompts show
    the taskset's tool, every episode is scored by its rubric (environment_reward, the default
    reward, is each trace's reward), no episode fails."""
    seen = {}

    def traces(prompts, completions, environments, environment_reward, **columns):
        seen.update(environments=environments, rewards=environment_reward)
        return [0.0] * len(completions)

    config = GRPOConfig(**OPTIONS, environment="verifiers:_vf_toy", output_dir=str(tmp_path / "run"))
    model = tool_arithmetic.build_model(tokenizer, seed=0)
    assert config.dataset == "verifiers:_vf_toy"
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, reward_funcs=["environment_reward", traces])
    assert trainer.rows == verifiers_rows("_vf_toy")
    assert "calculator_add(a, b)" in trainer.source.next(0, 0).prompts[0]
    metrics = trainer.train_step()
    assert metrics["env/errors"] == 0 and "rewards/environment_reward" in metrics
    assert len(seen["environments"]) == 4 and all(isinstance(t, vf.Trace) for t in seen["environments"])
    assert seen["rewards"] == [t.reward for t in seen["environments"]]
    assert all(t.rewards["correct"] is not None for t in seen["environments"])


class BoxTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    NEEDS_CONTAINER = True

    @vf.stop
    async def on_reply(self, response: vf.Response) -> bool:
        return False


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self):
        yield BoxTask(vf.TaskData(prompt="hi"), self.config.task)


def test_what_cannot_run_in_process_is_refused_by_name(monkeypatch):
    """A task that needs a container, a stop hook on the model's responses and a rubric without
    a reward are named before any episode runs; without the package, the error names the extra."""
    with pytest.raises(ValueError) as error:
        verifiers_factory(BoxTaskset(vf.TasksetConfig()))
    for cause in ("BoxTaskset", "container", "['on_reply']", "has no reward"):
        assert cause in str(error.value)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"grpo-fast\[verifiers\]"):
        taskset_of("verifiers:_vf_toy")
