"""Prompt sources and their reward functions: a built-in task (the arithmetic demo, the
tool-use task), a dataset, reasoning-gym's generated tasks (``reasoning_gym:<task>``), or a
verifiers taskset's tasks (``verifiers:<taskset id>``, played in its environment).

Reward functions are named in configs: a built-in task's name (its reward), a reward function of
``grpo_fast.rewards`` (its ``REWARD_FUNCTIONS``: ``math_reward``, ``format_reward``, ...), or
``"package.module:function"``.
"""

import importlib
from collections.abc import Callable

from grpo_fast.environments.verifiers import is_verifiers, verifiers_rows
from grpo_fast.tasks.reasoning_gym import is_reasoning_gym, reasoning_gym_rows

# The built-in tasks (--task NAME, without --dataset): name -> "module:reward function", imported
# when picked. A task's module has build_tokenizer(), build_model(tokenizer, seed, **sizes),
# build_dataset(seed=, hold_out=) and held_out_rows(); its reward, named as the task, scores it
# by default.
TASKS = {
    "arithmetic": "grpo_fast.tasks.arithmetic:arithmetic_reward",
    "tool_arithmetic": "grpo_fast.tasks.tool_arithmetic:tool_arithmetic_reward",
    "guess_number": "grpo_fast.tasks.guess_number:environment_reward",
}
# A task's own settings, a layer above the config's defaults and below a YAML file and the flags
# (GRPOConfig.__post_init__): the tool task's trajectory (a call, the calculator's answer, the
# final answer) needs about 22 tokens. guess_number plays in its environment (3 guesses of 2
# tokens, 2 answers of 10: 26 tokens) and evaluates on its balanced games every 50 steps; its
# RL settings are those measured in benchmarks/bench_guess_number.py (see the task's module).
TASK_SETTINGS = {
    "tool_arithmetic": {"max_new_tokens": 32},
    "guess_number": {
        "environment": "guess_number",
        "max_turns": 3,
        "max_new_tokens": 32,
        "steps": 300,
        "batch_size": 64,
        "group_size": 4,
        "learning_rate": 3e-3,
        "num_iterations": 4,
        "beta": 0.02,
        "eval_every": 50,
    },
}
DATASET_REWARDS = ("math_reward",)
REASONING_GYM_REWARDS = ("reasoning_gym_reward",)


def task_module(name: str | None):
    """The module of the built-in task ``name`` (None: the arithmetic demo)."""
    return importlib.import_module(TASKS[name or "arithmetic"].split(":")[0])


def get_reward_function(name) -> Callable:
    """Resolves a reward function by name (or returns a callable unchanged)."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise TypeError(f"reward_funcs entries must be names or callables, got {name!r}")
    if ":" in name or name in TASKS:  # a task's module is imported when used: it loads torch
        module_name, _, attr = TASKS.get(name, name).partition(":")
        try:
            func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"reward function {name!r} cannot be imported: {exc}") from exc
    else:
        rewards = importlib.import_module("grpo_fast.rewards")
        if name not in rewards.REWARD_FUNCTIONS:
            known = [*TASKS, *rewards.REWARD_FUNCTIONS]
            raise ValueError(f"unknown reward function {name!r}; known: {known} or 'package.module:function'")
        func = getattr(rewards, name)
    if not callable(func):
        raise ValueError(f"reward function {name!r} is not callable")
    return func


def resolve_rewards(names, dataset: str | None, task: str | None = None, environment: bool = False) -> tuple:
    """``(functions, their names)`` of reward ``names`` (None = the task's: the built-in task's
    reward when ``dataset`` is None, reasoning_gym_reward for reasoning-gym tasks, else
    math_reward; in an ``environment`` its episodes' rewards, environment_reward, unless a
    built-in task names its own)."""
    if names is None and environment and task is None:
        names = ("environment_reward",)
    if names is None:
        if dataset is None:
            names = (task or "arithmetic",)
        else:
            names = REASONING_GYM_REWARDS if is_reasoning_gym(dataset) else DATASET_REWARDS
    funcs = [get_reward_function(name) for name in names]
    return funcs, [getattr(f, "__name__", str(f)) for f in funcs]


def load_rows(
    dataset: str | None,
    *,
    tokenizer=None,
    seed: int = 0,
    hold_out: bool = False,
    task: str | None = None,
    held_out: bool = False,
    tools: list | None = None,
    **options,
) -> list:
    """Prompt rows: the built-in ``task``'s when ``dataset`` is None (``hold_out``: without its
    held-out rows; ``held_out``: those rows alone), else the dataset's: reasoning-gym's
    generated rows for ``reasoning_gym:<task>`` (from ``seed``, or ``held_out``: the eval rows'
    seed; see ``grpo_fast.tasks.reasoning_gym``), a verifiers taskset's tasks for
    ``verifiers:<taskset id>`` (rows for its environment, which renders their prompts: no
    ``tokenizer``), else a file's or the Hub's.

    ``tools``: the tools' JSON schemas, which a chat template shows in every prompt.
    ``options``: prompt_column, prompt_template, answer_column, system_prompt, config, split (see
    ``load_prompt_dataset``).
    """
    from grpo_fast.tasks.datasets import format_prompts, load_prompt_dataset

    if dataset is None:
        module = task_module(task)
        rows = module.held_out_rows() if held_out else module.build_dataset(seed=seed, hold_out=hold_out)
        system_prompt = options.get("system_prompt")
        return format_prompts(rows, tokenizer, system_prompt, tools) if tokenizer is not None else rows
    if is_reasoning_gym(dataset):
        system_prompt = options.get("system_prompt")
        return reasoning_gym_rows(
            dataset, tokenizer=tokenizer, seed=seed, held_out=held_out, system_prompt=system_prompt, tools=tools
        )
    if is_verifiers(dataset):
        if tokenizer is not None:
            raise ValueError(f"dataset {dataset!r}: a verifiers taskset's tasks play in its environment: give it too")
        return verifiers_rows(dataset)
    rows = load_prompt_dataset(dataset, tokenizer=tokenizer, tools=tools, **options)
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no rows")
    return rows
