"""Format reward: does the completion follow the required layout?"""

import re

from grpo_fast.rewards.base import check_batch, completion_texts

# Reasoning in <think>, then the final answer in <answer>, nothing else around them.
DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_reward(
    prompts: list[str], completions: list[str], *, pattern: str | re.Pattern = DEFAULT_FORMAT, **columns
) -> list[float]:
    """1.0 when the whole completion (stripped of surrounding whitespace) matches `pattern`, else 0.0.

    prompts, completions: N strings.
    pattern: a regex (str, compiled with re.DOTALL so `.` spans lines, or a compiled
        re.Pattern used as is); default `<think>...</think><answer>...</answer>`.
        Bind another with functools.partial(format_reward, pattern=...).
    Example:
        >>> format_reward(["q"], ["<think>2+2=4</think>\\n<answer>4</answer>"])
        [1.0]
    """
    check_batch(prompts, completions, columns)
    completions = completion_texts(completions)
    if isinstance(pattern, str):
        pattern = re.compile(pattern, re.DOTALL)
    elif not isinstance(pattern, re.Pattern):
        raise TypeError(f"pattern must be a str or re.Pattern, got {type(pattern).__name__}")
    return [float(pattern.fullmatch(c.strip()) is not None) for c in completions]
