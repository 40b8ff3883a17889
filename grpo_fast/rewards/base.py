"""The reward-function contract: argument checks and an opt-in "score None on error" wrapper.

A reward function is `f(prompts, completions, **columns) -> list[float | None]`: `prompts`
and `completions` are lists of N strings (with tools, each completion is the trajectory's
messages, TRL's shape: the assistant turns and the tool messages; `completion_texts` gives
the final answers), each column (e.g. `answer=[...]`,
`tests=[...]`, `completion_ids=[...]`) is a list of N values aligned with them, and the
result holds N scores, None for a sample the function does not score. Functions accept and
ignore columns they do not use, so ours and the user's can be mixed freely.
"""

import functools
from collections.abc import Callable, Sequence

RewardFn = Callable[..., list]


def check_batch(prompts, completions, columns: dict) -> int:
    """Validate the reward-function arguments; returns N."""
    for name, value in (("prompts", prompts), ("completions", completions)):
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
            raise TypeError(f"{name} must be a list of N strings, got {type(value).__name__}")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompts must have the same length N={n} as completions, got {len(prompts)}")
    for i, c in enumerate(completions):
        if not isinstance(c, str) and not _is_messages(c):
            raise TypeError(
                f"completions[{i}] must be a str or a list of {{'role', 'content'}} messages, got {type(c).__name__}"
            )
    for name, value in columns.items():
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
            raise TypeError(f"column {name!r} must be a list of N={n} values, got {type(value).__name__}")
        if len(value) != n:
            raise ValueError(f"column {name!r} must have length N={n} (one value per completion), got {len(value)}")
    return n


def completion_texts(completions) -> list[str]:
    """The text each completion answers with: a str as it is; a trajectory (a list of messages,
    a multi-turn rollout with tools) its last assistant message's content ("" without one)."""
    return [c if isinstance(c, str) else _final_answer(c) for c in completions]


def _final_answer(messages: list) -> str:
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def none_on_error(fn: RewardFn) -> RewardFn:
    """Wrap a reward function so that the samples on which it raises score None.

    By default a reward function that raises stops the run (the trainer names the function
    and the sample); wrap it with this to skip such samples instead. When the batch call
    raises, the samples are re-scored one at a time and only the failing ones get None.
    """

    @functools.wraps(fn)
    def wrapper(prompts, completions, **columns):
        n = check_batch(prompts, completions, columns)
        try:
            return list(fn(prompts, completions, **columns))
        except Exception:  # noqa: BLE001 - any error of the user's function is the point
            scores = []
            for i in range(n):
                try:
                    scores.extend(fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in columns.items()}))
                except Exception:  # noqa: BLE001
                    scores.append(None)
            return scores

    return wrapper
