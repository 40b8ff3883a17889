"""recipes/*.yaml: each loads as a GRPOConfig, its column mapping brings a clean reference to
its rewards (a right answer in the asked-for format scores the most, a wrong one less), one
training step runs, and its header's predicted memory matches the arithmetic it states.

Nothing is downloaded: the recipe's Hub model and datasets are swapped for the demo's tiny
model with a Hermes-style chat template (tests/_hermes.py: Qwen2.5's layout, tools included,
prefix-preserving, so every recipe's prompts are chat-formatted as with Qwen and a recipe with
`tools` starts its tool loop) saved to a folder, and JSONL files with the columns the recipe
names, in rows shaped like the Hub dataset's (GSM8K's "#### 42" answers, MATH's \\boxed{}
solutions, MBPP's test lists). A new recipe is covered as soon as it exists; one whose dataset
has no rows below fails, asking for them. A recipe with tools is also scored on trajectories
(message lists, as the tool loop gives the rewards), and its one step runs with the tools on.
A recipe with an environment is scored on episodes played through it (each completion an
attempt; a wrong one, then the right one after the feedback), and its one step runs the episodes.
"""

import glob
import json
import math
import os
import re

import pytest
import torch
from _hermes import make_tokenizer
from conftest import write_jsonl

from grpo_fast.tasks.arithmetic import build_model
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.rollout.samples import score
from grpo_fast.trainer.run.evaluation import check_reward_columns, load_eval_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The GPU recipes; a *_cpu.yaml recipe trains a real model that a package ships, on this host
# (tests/test_real_models.py runs it).
RECIPES = sorted(p for p in glob.glob(os.path.join(ROOT, "recipes", "*.yaml")) if not p.endswith("_cpu.yaml"))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

# Per Hub dataset: two rows shaped like its own, and for the first a completion that is right
# in the format every recipe asks for, one right in substance but not in layout, one wrong.
GSM8K_ROWS = [
    {
        "question": "Tom has 3 boxes of 4 apples and eats 2. How many apples are left?",
        "answer": "He had 3 * 4 = <<3*4=12>>12 apples.\n12 - 2 = <<12-2=10>>10 are left.\n#### 10",
    },
    {"question": "What is 1,000 + 234?", "answer": "1,000 + 234 = <<1000+234=1234>>1234\n#### 1,234"},
]
MATH_ROWS = [
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
    },
    {
        "problem": "Solve $x^2 = 4$ for $x > 0$.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "Since $x > 0$, $x = \\boxed{2}$.",
    },
]
MATH500_ROWS = [
    {**row, "answer": answer, "subject": row["type"], "unique_id": f"test/{i}.json"}
    for i, (row, answer) in enumerate(zip(MATH_ROWS, ["\\frac{3}{4}", "2"]))
]
MBPP_ROWS = [
    {
        "task_id": 2,
        "text": "Write a function to find the shared elements from the given two lists.",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "test_list": [
            "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
            "assert set(similar_elements((1, 2, 3, 4), (5, 4, 3, 7))) == set((3, 4))",
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
    {
        "task_id": 3,
        "text": "Write a python function to identify non-prime numbers.",
        "code": "def is_not_prime(n):\n    return n < 2 or any(n % k == 0 for k in range(2, n))",
        "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True"],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
]
CODE = "```python\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))\n```"
WRONG_CODE = "```python\ndef similar_elements(a, b):\n    return ()\n```"
HUB_ROWS = {
    "openai/gsm8k": (
        GSM8K_ROWS,
        "<think>3 * 4 = 12, 12 - 2 = 10</think>\n<answer>10</answer>",
        "3 * 4 = 12 and 12 - 2 = 10, so 10 apples.",
        "<think>3 * 4 = 12, 12 + 2 = 14</think>\n<answer>14</answer>",
    ),
    "DigitalLearningGmbH/MATH-lighteval": (
        MATH_ROWS,
        "<think>1/2 + 1/4 = 0.75</think>\n<answer>\\boxed{\\frac{3}{4}}</answer>",
        "It is $\\boxed{0.75}$.",
        "<think>1/2 + 1/4 = 2/6</think>\n<answer>\\boxed{\\frac{1}{3}}</answer>",
    ),
    "HuggingFaceH4/MATH-500": (MATH500_ROWS, None, None, None),  # an eval set only
    "google-research-datasets/mbpp": (
        MBPP_ROWS,
        f"<think>Intersect the sets.</think>\n<answer>\n{CODE}\n</answer>",
        CODE,
        f"<think>Nothing is shared.</think>\n<answer>\n{WRONG_CODE}\n</answer>",
    ),
}
# Per Hub dataset a recipe with tools trains on: trajectories for its first row, as the tool loop
# gives them to the rewards (assistant turns with their tool_calls, the tool messages, the final
# assistant message): one that answers right in its final message, and one whose final message is
# wrong although an earlier turn had the right answer (the rewards score the final message).
_CALL = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1/2 + 1/4)"}}}
TRAJECTORIES = {
    "DigitalLearningGmbH/MATH-lighteval": (
        [
            {"role": "assistant", "content": "Let me compute it.", "tool_calls": [_CALL]},
            {"role": "tool", "name": "python", "content": "0.75"},
            {"role": "assistant", "content": "The program printed 0.75, so the answer is $\\boxed{\\frac{3}{4}}$."},
        ],
        [
            {"role": "assistant", "content": "Maybe $\\boxed{\\frac{3}{4}}$; let me check.", "tool_calls": [_CALL]},
            {"role": "tool", "name": "python", "content": "0.75"},
            {"role": "assistant", "content": "So the answer is $\\boxed{\\frac{1}{3}}$."},
        ],
    ),
}
# The reference answer the loader leaves in the first row's "answer" (None: the rewards read other columns).
REFERENCE_ANSWERS = {
    "openai/gsm8k": "10",
    "DigitalLearningGmbH/MATH-lighteval": "\\frac{3}{4}",
    "google-research-datasets/mbpp": None,
}
# What the first row's prompt must show the model: the question, and for code the function the tests call.
PROMPT_SHOWS = {
    "openai/gsm8k": GSM8K_ROWS[0]["question"],
    "DigitalLearningGmbH/MATH-lighteval": MATH_ROWS[0]["problem"],
    "google-research-datasets/mbpp": MBPP_ROWS[0]["test_list"][0],
}

# The shapes of the models recipes train (nothing is downloaded: the shape is the config's).
MODEL_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
GiB = 2**30


def test_there_are_recipes():
    assert RECIPES, "recipes/ holds no *.yaml"


def recipe_id(path):
    return os.path.basename(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The demo's model with a byte-level tokenizer whose chat template is Hermes-style (renders
    tools, prefix-preserving), in a save_pretrained folder, with room for long prompts."""
    path = tmp_path_factory.mktemp("model")
    tokenizer = make_tokenizer()
    build_model(tokenizer, max_position_embeddings=2048).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def hub_rows(name):
    assert name in HUB_ROWS, f"add rows shaped like {name!r}'s (and completions) to HUB_ROWS in {__file__}"
    return HUB_ROWS[name]


def play(environment, row: dict, turns: list) -> tuple:
    """An episode of ``environment`` (the trainer's factory) on ``row`` in which the model says
    ``turns`` (until one ends it), as the turn loop gives it to the rewards: ``(the model's turns
    and the observations between them, the episode's reward: the sum of its steps', its state)``."""
    env, messages, observations, reward = environment(), [], [], None
    env.reset(row)
    for content in turns:
        messages += observations  # what answered the previous turn
        messages.append({"role": "assistant", "content": content})
        observations, done, step_reward = env.step(messages[-1])
        reward = reward if step_reward is None else (reward or 0.0) + step_reward
        if done:
            break
    return messages, reward, env.state


def local_config(path, tmp_path, model, **overrides) -> GRPOConfig:
    """The recipe with its model and datasets swapped for local ones: everything else, the
    column mapping, the system prompt and the rewards included, as the recipe has it."""
    recipe = GRPOConfig.from_yaml(path)
    files = {}
    for key in ("dataset", "eval_dataset"):
        name = getattr(recipe, key)
        if name is not None:
            files[key] = write_jsonl(tmp_path / f"{key}.jsonl", hub_rows(name)[0])
    return GRPOConfig.from_yaml(path, model=model, output_dir=str(tmp_path / "run"), **files, **overrides)


@pytest.mark.parametrize("path", RECIPES, ids=recipe_id)
def test_the_recipe_is_a_valid_config_with_its_command_in_the_header(path):
    config = GRPOConfig.from_yaml(path)
    header = open(path).read()
    assert f"grpo-fast train --config recipes/{os.path.basename(path)}" in header
    assert re.search(r"Predicted peak GPU memory: [\d.]+ GiB", header), "the header predicts the peak memory"
    assert re.search(r"Predicted time: .*not yet measured", header), "the header predicts the time"
    assert re.search(r"Generator: " + re.escape(config.generator), header), "the header says why this generator"
    assert config.model in MODEL_SHAPES and config.dataset is not None and config.eval_dataset is not None
    assert config.max_tokens_per_micro_batch is not None, "a token budget bounds the update's memory"
    assert config.precision == "auto" and config.reward_funcs
    if config.tools:
        assert config.max_new_tokens >= 2 * config.max_tool_response_tokens, "room for turns and results"
        assert re.search(r"Predicted time:.*sandbox", header, re.DOTALL), "the time counts the tool calls"
    if config.environment:
        assert config.max_turns is not None, "an episode's attempts are bounded"
        assert re.search(r"Predicted time:.*sandbox", header, re.DOTALL), "the time counts the environment's steps"


@pytest.mark.parametrize("path", RECIPES, ids=recipe_id)
def test_the_column_mapping_reaches_the_rewards(path, tmp_path, tiny_model):
    """The trainer's own rows and rewards: the right answer in the asked-for format scores the
    sum of the weights, the right answer in another layout less, a wrong answer less still."""
    config = local_config(path, tmp_path, tiny_model, generator="sampler", report_to=None)
    trainer = GRPOTrainer(config)
    episode = {"environment_reward": 0.0} if config.environment else {}  # the column the turn loop adds
    try:
        rows, funcs, environment = trainer.rows, trainer.reward_funcs, trainer.environment
        check_reward_columns([{**rows[0], **episode}], funcs, "dataset")
        check_reward_columns([{**load_eval_rows(config, trainer.tokenizer)[0], **episode}], funcs)
        # in an environment the model sees the prompt its episodes' reset gives, as the template renders it
        prompt = trainer.turn_loop(rows[:1], 1).prompts[0] if environment else rows[0]["prompt"]
    finally:
        trainer.close()
    hub_name = GRPOConfig.from_yaml(path).dataset
    _, right, unformatted, wrong = hub_rows(hub_name)
    row = rows[0]  # the file's first row: the loader keeps the order
    assert row.get("answer") == REFERENCE_ANSWERS[hub_name], "the rewards get the clean final answer"
    assert PROMPT_SHOWS[hub_name] in prompt, "the prompt shows what the model must answer"
    if "format_reward" in config.reward_funcs:
        assert "<think>" in prompt and "<answer>" in prompt, "the prompt asks for the checked format"
    for name in config.tools or []:
        assert f'"name": "{name}"' in row["prompt"], "the prompt shows the tool's schema"
    completions = [right, unformatted, wrong]
    columns = {key: [value] * 3 for key, value in row.items() if key != "prompt"}
    if environment:  # each completion is the one attempt of an episode
        completions, columns["environment_reward"], columns["environments"] = map(
            list, zip(*(play(environment, row, [completion]) for completion in completions))
        )
    rewards = score(funcs, [row["prompt"]] * 3, completions, columns)  # [3, K]
    weights = torch.tensor(config.reward_weights or [1.0] * len(funcs))
    total = (rewards * weights).sum(1).tolist()
    assert rewards[0].tolist() == [1.0] * len(funcs), dict(zip(config.reward_funcs, rewards[0].tolist()))
    assert total[0] == pytest.approx(weights.sum().item())
    if "format_reward" in config.reward_funcs:
        assert total[0] > total[1] > total[2], total
    else:  # the layout is not rewarded: a right answer is right in any
        assert total[0] == total[1] > total[2], total
    assert total[0] >= config.eval_pass_threshold > total[2], "eval's pass threshold separates right from wrong"
    if config.tools:  # the rewards get trajectories: the final assistant message is scored
        assert hub_name in TRAJECTORIES, f"add trajectories for {hub_name!r} to TRAJECTORIES in {__file__}"
        trajectories = list(TRAJECTORIES[hub_name])
        columns = {key: [value] * 2 for key, value in row.items() if key != "prompt"}
        rewards = score(funcs, [row["prompt"]] * 2, trajectories, columns)
        total = (rewards * weights).sum(1).tolist()
        assert total[0] == pytest.approx(weights.sum().item()), dict(zip(config.reward_funcs, rewards[0].tolist()))
        assert total[0] >= config.eval_pass_threshold > total[1], total
    if environment:  # a wrong attempt, then the right one after the environment's answer, scores as right
        trajectory, reward, _ = play(environment, row, [wrong, right])
        assert [m["role"] for m in trajectory] == ["assistant", "user", "assistant"], trajectory
        columns = {key: [value] for key, value in row.items() if key != "prompt"}
        rewards = score(funcs, [row["prompt"]], [trajectory], {**columns, "environment_reward": [reward]})
        total = (rewards * weights).sum(1).tolist()
        assert total[0] == pytest.approx(weights.sum().item()), dict(zip(config.reward_funcs, rewards[0].tolist()))


@pytest.mark.parametrize("path", RECIPES, ids=recipe_id)
def test_one_training_step_of_the_recipe(path, tmp_path, tiny_model):
    """The recipe's options at a tiny size: one step, sampled, scored, updated and evaluated."""
    config = local_config(
        path,
        tmp_path,
        tiny_model,
        steps=1,
        batch_size=4,
        group_size=2,
        max_new_tokens=4,
        max_prompt_length=32,
        eval_every=1,
        eval_samples=2,
        save_every=0,
        progress=False,
        generator="sampler",  # the recipe's vllm engine would start vLLM on the CPU: minutes
        report_to=None,
    )
    trainer = GRPOTrainer(config)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert len(history) == 1 and math.isfinite(history[0]["loss"])
    assert os.path.isdir(tmp_path / "run" / "final")
    if config.tools:  # the step ran the tool loop (the tiny random model rarely calls a tool)
        assert "tools/call_frequency" in history[0] and "tools/turns_mean" in history[0], sorted(history[0])
    if config.environment:  # the step played its episodes
        assert "env/turns_mean" in history[0] and "env/success" in history[0], sorted(history[0])


def predicted_peak_bytes(config: GRPOConfig) -> float:
    """The peak of the update the headers state: fp32 weights, grads and AdamW's m and v (16 B a
    parameter), a frozen fp32 reference when beta > 0, activations of one micro-batch at the
    token budget (gradient checkpointing: each layer's fp32 input, plus one layer recomputed,
    whose per-token cost is the 100m preset's measured one scaled by the layer widths), and
    the fused LM head's 1 GiB logits chunk, fp32 weight gradient and bf16 weight copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = MODEL_SHAPES[config.model]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **shape))
    P = sum(p.numel() for p in model.parameters())
    rest, tokens = {}, {}
    for micro in (1, 8):
        with open(os.path.join(RESULTS, f"memory_cpu_100m_micro{micro}.json")) as f:
            result = json.load(f)
        settings = result["meta"]["settings"]
        rest[micro] = result["grpo_fused"]["rest_bytes"]
        tokens[micro] = settings["micro_batch"] * (settings["prompt_length"] + settings["completion_length"])
    bench = settings["model"]
    per_token = (rest[8] - rest[1]) / (tokens[8] - tokens[1])  # 0.222 MiB on the 100m preset
    per_layer_token = per_token / (bench["num_hidden_layers"] * (bench["hidden_size"] + bench["intermediate_size"]))
    layer = per_layer_token * (shape["hidden_size"] + shape["intermediate_size"])
    assert config.gradient_checkpointing and config.fused_linear, "the stated arithmetic assumes both"
    activations = config.max_tokens_per_micro_batch * (shape["num_hidden_layers"] * shape["hidden_size"] * 4 + layer)
    head = GiB + shape["vocab_size"] * shape["hidden_size"] * (4 + 2)
    return 16 * P + (4 * P if config.beta else 0) + activations + head


@pytest.mark.parametrize("path", RECIPES, ids=recipe_id)
def test_the_predicted_memory_is_the_stated_arithmetic(path):
    config = GRPOConfig.from_yaml(path)
    stated = float(re.search(r"Predicted peak GPU memory: ([\d.]+) GiB", open(path).read()).group(1))
    assert stated == pytest.approx(predicted_peak_bytes(config) / GiB, abs=0.1)


def test_a_prompt_template_and_mbpp_test_list(tmp_path):
    """What the MBPP recipe relies on: prompt_template, a prompt made of columns (a list one item
    per line, every column kept for the rewards) and code_reward reading MBPP's test_list."""
    from grpo_fast.rewards import SandboxLimits, code_reward
    from grpo_fast.tasks.datasets import load_prompt_dataset

    path = write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS[1:])
    rows = load_prompt_dataset(path, prompt_template="{text}\nTests:\n{test_list}")
    assert rows[0]["prompt"] == "\n".join([MBPP_ROWS[1]["text"], "Tests:", *MBPP_ROWS[1]["test_list"]])
    assert rows[0]["text"] == MBPP_ROWS[1]["text"] and rows[0]["test_list"] == MBPP_ROWS[1]["test_list"]
    for template, message in [
        ("{txt}", "prompt_template's column 'txt' is not in"),
        ("{}", "must name whole columns"),
        ("{text", "is malformed"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_prompt_dataset(path, prompt_template=template)
    program = "```python\n" + MBPP_ROWS[1]["code"] + "\n```"
    limits = SandboxLimits(wall_time_s=10)
    assert code_reward(["p"], [program], test_list=[MBPP_ROWS[1]["test_list"]], limits=limits) == [1.0]
    with pytest.raises(ValueError, match="needs a tests column"):
        code_reward(["p"], [program])
