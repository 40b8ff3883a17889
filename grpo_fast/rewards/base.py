"""The reward-function contract: argument checks and an opt-in "score None on error" wrapper.

A reward function is `f(prompts, completions, **columns) -> list[float | None]`: `prompts`
and `completions` are lists of N strings, each column (e.g. `answer=[...]`,
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
        if not isinstance(c, str):
            raise TypeError(f"completions[{i}] must be a str, got {type(c).__name__}")
    for name, value in columns.items():
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
            raise TypeError(f"column {name!r} must be a list of N={n} values, got {type(value).__name__}")
        if len(value) != n:
            raise ValueError(f"column {name!r} must have length N={n} (one value per completion), got {len(value)}")
    return n


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
