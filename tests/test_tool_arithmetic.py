"""grpo_fast.tasks.tool_arithmetic: the tokenizer and its chat template, the dataset, the reward,
the warm start (issue 27's built-in tool task). No download: everything is built here."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from grpo_fast.tasks import tool_arithmetic as task  # noqa: E402
from grpo_fast.tools import ToolTemplate, parse_tool_calls, resolve_tools  # noqa: E402
from grpo_fast.tools.calculator import calculator  # noqa: E402


def solve(model, tokenizer, rows: list, *, tools: bool) -> list:
    """One greedy (top-k 1) trajectory of ``model`` per row through the trainer's own rollout:
    our sampler and, with ``tools``, the tool loop with the calculator. Returns the completions
    as the rewards get them (each row's messages with tools, else its text)."""
    from grpo_fast.tasks.datasets import format_prompts
    from grpo_fast.trainer.config import GRPOConfig
    from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator
    from grpo_fast.trainer.rollout.samples import rollout
    from grpo_fast.trainer.rollout.turns import TurnLoop

    config = GRPOConfig(task="tool_arithmetic", tools=list(task.TOOLS) if tools else None, top_k=1)
    template = ToolTemplate(tokenizer, list(task.TOOLS)) if tools else None
    rows = format_prompts(rows, tokenizer, tools=template.schemas if tools else None)
    engine = make_generator("sampler", model, tokenizer, EngineSettings.of(config))
    loop = TurnLoop(template, config.tooling) if tools else None
    return rollout(engine, rows, list(range(len(rows))), [], group_size=1, turns=loop).completions


@pytest.fixture(scope="module")
def tokenizer():
    return task.build_tokenizer()


@pytest.fixture(scope="module")
def template(tokenizer):
    return ToolTemplate(tokenizer, ["calculator"])


def call_message(expression, content=""):
    function = {"name": "calculator", "arguments": {"expression": expression}}
    return {"role": "assistant", "content": content, "tool_calls": [{"type": "function", "function": function}]}


def conversation(prompt="347*28", result="9716", answer="9716"):
    return [
        {"role": "user", "content": prompt},
        call_message(prompt),
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": answer},
    ]


def render(tokenizer, messages, tools=None, tokenize=False, generation_prompt=False):
    out = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=tokenize,
        add_generation_prompt=generation_prompt,
        **({"return_dict": False} if tokenize else {}),
    )
    return list(out) if tokenize else out


def test_tokenizer_round_trips_the_renderings(tokenizer, template):
    schemas = template.schemas + [t.schema for t in resolve_tools(["python"])]
    for messages, tools in [
        (conversation(), template.schemas),
        (conversation(), schemas),
        ([{"role": "system", "content": "Be brief."}] + conversation(), template.schemas),
        ([{"role": "user", "content": "347*28"}, {"role": "assistant", "content": "9716"}], None),
        ([{"role": "user", "content": "What is 12 / 7? ~{}[]"}], None),
    ]:
        text = render(tokenizer, messages, tools)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # without tools (and no system message) the prompt is only the user turn
    prompt = render(tokenizer, [{"role": "user", "content": "347*28"}], generation_prompt=True)
    assert prompt == "<|im_start|>user\n347*28<|im_end|>\n<|im_start|>assistant\n"
    assert "calculator(expression)" in render(tokenizer, [{"role": "user", "content": "1"}], template.schemas)


def test_a_call_is_few_tokens(tokenizer):
    ids = tokenizer.encode(task.CALL_OPEN + "347*28" + task.CALL_CLOSE + "<|im_end|>", add_special_tokens=False)
    assert len(ids) == 6  # open, 347, *, 28, close, EOS
    assert tokenizer.convert_ids_to_tokens(ids)[1:4] == ["347", "*", "28"]
    assert tokenizer.tokenize("10005") == ["100", "05"]
    assert len(tokenizer) == 1214


def test_tool_template_accepts_it(tokenizer, template):
    assert template.end_of_turn_ids == [tokenizer.eos_token_id]
    assert template.stop_strings == ["</tool_call>"]


def test_prompt_turn_suffix_is_the_full_rendering(tokenizer, template):
    messages = conversation()
    prompt = template.prompt_ids(messages[:1])
    turn = tokenizer.encode(task.CALL_OPEN + "347*28" + task.CALL_CLOSE, add_special_tokens=False)
    turn.append(tokenizer.eos_token_id)
    assert prompt + turn == render(tokenizer, messages[:2], template.schemas, tokenize=True)[: len(prompt + turn)]
    suffix = template.tool_suffix_ids([calculator("347*28")], completion_ids=turn)
    answer = tokenizer.encode("9716", add_special_tokens=False) + [tokenizer.eos_token_id]
    full = render(tokenizer, messages, template.schemas, tokenize=True)
    assert prompt + turn + suffix + answer == full[: len(prompt + turn + suffix + answer)]
    assert tokenizer.decode(full[len(prompt + turn + suffix + answer) :], skip_special_tokens=False) == "\n"
    # what the warm start trains on is that same sequence, the assistant's tokens unmasked
    ids, mask = task.demonstration(tokenizer, {"prompt": "347*28", "answer": "9716"}, template)
    assert ids == prompt + turn + suffix + answer
    assert [i for i, m in zip(ids, mask) if m] == turn + answer
    # the parser reads the sampled turn back
    content, calls = parse_tool_calls(tokenizer.decode(turn, skip_special_tokens=False), tokenizer)
    assert content == "" and calls[0].name == "calculator" and calls[0].arguments == {"expression": "347*28"}


def test_dataset():
    held = task.held_out_rows()
    assert len(held) == len({row["prompt"] for row in held}) == 64
    rows = task.build_dataset(5000, seed=3, hold_out=True)
    assert not {row["prompt"] for row in held} & {row["prompt"] for row in rows}
    for row in rows[:200] + held:
        a, b = map(int, row["prompt"].split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and row["answer"] == str(a * b)
    assert task.build_dataset(50, seed=1) == task.build_dataset(50, seed=1) != task.build_dataset(50, seed=2)
    assert task.REWARDS == ("tool_arithmetic_reward",)


def test_reward_on_both_completion_shapes():
    answers = ["9716", "9716", "9716", "9716"]
    strings = ["9716", " 9716<|im_end|>", "9700", "the answer is 9716"]
    rewards = task.tool_arithmetic_reward([""] * 4, strings, answers)
    assert rewards[:2] == [1.0, 1.0] and rewards[3] == 0.0
    assert 0.0 < rewards[2] < 0.1
    trajectories = [conversation()[1:], conversation(answer="9715")[1:], conversation()[1:3], [call_message("1")]]
    rewards = task.tool_arithmetic_reward([""] * 4, trajectories, answers)
    assert rewards[0] == 1.0 and 0.09 < rewards[1] < 0.1 and rewards[2:] == [0.0, 0.0]
    assert task.tool_arithmetic_reward([""], ["9716"], [9716]) == [1.0]


def test_warm_start_teaches_the_format(tokenizer):
    """A short warm start (100 steps, a few seconds): the tools model calls the calculator on most
    held-out prompts (greedy), the no-tools model answers with a number."""
    rows = task.held_out_rows()
    with_tools = task.build_model(tokenizer, seed=0)
    report = task.warm_start(with_tools, tokenizer, tools=True, seed=0, steps=100)
    assert report["seconds"] > 0 and report["loss"] < 3.5
    trajectories = solve(with_tools, tokenizer, rows, tools=True)
    called = [
        t for t in trajectories if t[0].get("tool_calls") and t[0]["tool_calls"][0]["function"]["name"] == "calculator"
    ]
    assert len(called) >= 0.75 * len(rows)
    assert sum(set(t[0]["tool_calls"][0]["function"]["arguments"]) == {"expression"} for t in called) >= 0.75 * len(
        rows
    )

    without = task.build_model(tokenizer, seed=0)
    task.warm_start(without, tokenizer, tools=False, seed=0, steps=100)
    completions = solve(without, tokenizer, rows, tools=False)
    answers = [task.final_answer(t) for t in completions]
    assert sum(a.isdigit() for a in answers) >= 0.75 * len(rows)
    rewards = task.tool_arithmetic_reward(None, completions, [row["answer"] for row in rows])
    assert sum(r == 1.0 for r in rewards) <= 0.1 * len(rows)  # pass@1: a number, but rarely the product
