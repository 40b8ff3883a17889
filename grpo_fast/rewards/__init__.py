"""Verifiable rewards: `f(prompts, completions, **columns) -> list[float | None]`.

None means "not scored". Configure with functools.partial, e.g.
`partial(code_reward, limits=SandboxLimits(wall_time_s=2))`.
"""

from grpo_fast.rewards.base import check_batch, completion_texts, none_on_error
from grpo_fast.rewards.code import code_reward, extract_code
from grpo_fast.rewards.environment import environment_reward
from grpo_fast.rewards.format import DEFAULT_FORMAT, format_reward
from grpo_fast.rewards.math_answer import answers_match, extract_answer, math_reward
from grpo_fast.rewards.overlong import overlong_penalty
from grpo_fast.rewards.reasoning_gym import reasoning_gym_reward
from grpo_fast.sandbox import SandboxLimits, SandboxResult, run_python

# The reward functions among the names below, which a config may name; the rest are their
# building blocks (decorators, checks, answer extraction, the sandbox).
REWARD_FUNCTIONS = (
    "math_reward",
    "format_reward",
    "overlong_penalty",
    "code_reward",
    "reasoning_gym_reward",
    "environment_reward",
)

__all__ = [
    "REWARD_FUNCTIONS",
    "math_reward",
    "format_reward",
    "overlong_penalty",
    "code_reward",
    "reasoning_gym_reward",
    "environment_reward",
    "none_on_error",
    "check_batch",
    "completion_texts",
    "extract_answer",
    "answers_match",
    "extract_code",
    "DEFAULT_FORMAT",
    "SandboxLimits",
    "SandboxResult",
    "run_python",
]
