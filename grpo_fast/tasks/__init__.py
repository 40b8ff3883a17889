"""Prompt sources and their reward functions: the built-in arithmetic demo, or a dataset on disk.

Reward functions are named in configs: ``"arithmetic"`` (the demo's), a reward function of
``grpo_fast.rewards`` (its ``REWARD_FUNCTIONS``: ``math_reward``, ``format_reward``, ...), or
``"package.module:function"``.
"""

import importlib
from collections.abc import Callable

DEMO_REWARDS = ("arithmetic",)
DATASET_REWARDS = ("math_reward",)


def get_reward_function(name) -> Callable:
    """Resolves a reward function by name (or returns a callable unchanged)."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise TypeError(f"reward_funcs entries must be names or callables, got {name!r}")
    if name == "arithmetic":  # imported here: the demo's module loads torch and transformers
        from grpo_fast.tasks.arithmetic import arithmetic_reward

        return arithmetic_reward
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"reward function {name!r} cannot be imported: {exc}") from exc
    else:
        rewards = importlib.import_module("grpo_fast.rewards")
        if name not in rewards.REWARD_FUNCTIONS:
            known = ["arithmetic", *rewards.REWARD_FUNCTIONS]
            raise ValueError(f"unknown reward function {name!r}; known: {known} or 'package.module:function'")
        func = getattr(rewards, name)
    if not callable(func):
        raise ValueError(f"reward function {name!r} is not callable")
    return func


def resolve_rewards(names, dataset: str | None) -> tuple:
    """``(functions, their names)`` of reward ``names`` (None = the task's: the demo's when
    ``dataset`` is None, else math_reward)."""
    if names is None:
        names = DEMO_REWARDS if dataset is None else DATASET_REWARDS
    funcs = [get_reward_function(name) for name in names]
    return funcs, [getattr(f, "__name__", str(f)) for f in funcs]


def load_rows(dataset: str | None, *, tokenizer=None, seed: int = 0, hold_out: bool = False, **options) -> list:
    """Prompt rows: the arithmetic demo when ``dataset`` is None (``hold_out``: without its
    held-out sums), else the file or folder at that path.

    ``options``: prompt_column, prompt_template, answer_column, system_prompt, config, split (see
    ``load_prompt_dataset``).
    """
    if dataset is None:
        from grpo_fast.tasks.arithmetic import build_dataset

        return build_dataset(seed=seed, hold_out=hold_out)
    from grpo_fast.tasks.datasets import load_prompt_dataset

    rows = load_prompt_dataset(dataset, tokenizer=tokenizer, **options)
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no rows")
    return rows
