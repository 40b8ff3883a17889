"""The environment protocol, and the adapter that runs TRL's ``environment_factory`` classes
unchanged (``factory.py`` makes one environment per episode from either).

Our protocol (:class:`Environment`; either method may be ``async``)::

    reset(row) -> messages        the episode's first messages: a list of {"role", "content"}
                                  dicts, or a str (one user message); every episode of a group
                                  must start alike (GRPO compares G answers to one prompt)
    step(message) -> EnvStep      after each of the model's turns that calls no tool: the
                                  observations to append ([] or None when done; a str is one
                                  user message), whether the episode is done, and a reward for
                                  this step (None: none); the episode's reward is their sum
    tools() -> [callables]        what the model may call (default none): a turn that calls
                                  them is answered with their results, not by ``step``

TRL's ``environment_factory`` class (any class not derived from :class:`Environment`, as TRL
1.16 takes it): ``reset(**row)`` returns None or a str appended to the prompt's last message;
its public methods (not ``reset``, ``get_reward`` or ``_*``) are the tools; the episode ends at
the first turn without a tool call, scored by ``get_reward()`` where the class has one; reward
functions read the instances as ``environments=``, one per completion.
"""

import asyncio
import inspect
from typing import NamedTuple

# Methods of a TRL environment class that are not tools (TRL 1.16's rule; ``_*`` neither).
_TRL_NOT_TOOLS = ("reset", "get_reward")


class EnvStep(NamedTuple):
    """What an environment answers to one of the model's turns."""

    observations: list  # messages to append after the turn ([] when done)
    done: bool  # the episode is over
    reward: float | None = None  # this step's reward; None: none

    @classmethod
    def of(cls, value, where: str) -> "EnvStep":
        """``value`` (an EnvStep, or an ``(observations, done[, reward])`` tuple) checked and
        normalised; TypeError naming ``where`` for anything else."""
        if not isinstance(value, tuple) or len(value) not in (2, 3):
            raise TypeError(f"{where} must return an EnvStep or (observations, done, reward), got {value!r}")
        observations, done, *reward = value
        reward = reward[0] if reward else None
        if not isinstance(done, bool):
            raise TypeError(f"{where} returned done={done!r}; it must be a bool")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise TypeError(f"{where} returned reward={reward!r}; it must be a number or None")
        observations = [] if observations is None else as_messages(observations, where)
        if not done and not observations:
            raise TypeError(f"{where} returned no observation for an episode that goes on (done=False)")
        return cls(observations, done, None if reward is None else float(reward))


def as_messages(value, where: str) -> list:
    """``value`` as a list of chat messages (a str is one user message); TypeError naming ``where``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [dict(m) for m in value]
    raise TypeError(f"{where} must give a str or a list of {{'role': str, 'content': str}} messages, got {value!r}")


def prompt_messages(row: dict) -> list:
    """A dataset row's ``prompt`` as messages ([] when it has none)."""
    prompt = row.get("prompt")
    return [] if prompt is None else as_messages(prompt, "the row's prompt")


class Environment:
    """One episode's state; subclass it and implement :meth:`step` (and :meth:`reset`,
    :meth:`tools` where the defaults do not fit). Either of reset and step may be ``async``."""

    def reset(self, row: dict):
        """The episode's first messages, from its dataset ``row``; default: the row's prompt."""
        return prompt_messages(row)

    def step(self, message: dict) -> EnvStep:
        """Answers the model's turn ``message`` ({"role": "assistant", "content": str})."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def tools(self) -> list:
        """Functions the model may call in this episode (bound to it, as methods are); default none."""
        return []

    @property
    def state(self):
        """What reward functions read of the episode (``environments=``): the environment itself."""
        return self


class TRLEnvironment(Environment):
    """A TRL ``environment_factory`` instance ``env`` as an :class:`Environment`."""

    def __init__(self, env):
        self.env = env

    def reset(self, row: dict):
        messages = prompt_messages(row)
        extra = self.env.reset(**row)
        if extra is not None:
            if not isinstance(extra, str) or not messages:
                raise TypeError(
                    f"{type(self.env).__name__}.reset must return None or a str to append to the prompt (which the row "
                    f"must have), got {extra!r}"
                )
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + extra}
        return messages

    def step(self, message: dict) -> EnvStep:
        """A turn without a tool call ends TRL's episode, scored by ``get_reward`` where there is one."""
        get_reward = getattr(self.env, "get_reward", None)
        reward = None if get_reward is None else get_reward()
        if inspect.isawaitable(reward):
            reward = asyncio.run(_awaited(reward))
        return EnvStep([], True, reward)

    def tools(self) -> list:
        return [getattr(self.env, name) for name in trl_tool_names(type(self.env))]

    @property
    def state(self):
        return self.env


async def _awaited(awaitable):
    return await awaitable


def trl_tool_names(cls) -> list:
    """The tools of a TRL environment class: its public functions, sorted (TRL 1.16's rule)."""
    return sorted(
        name
        for name, _ in inspect.getmembers(cls, inspect.isfunction)
        if name not in _TRL_NOT_TOOLS and not name.startswith("_")
    )
