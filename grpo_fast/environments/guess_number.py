"""The built-in ``guess_number`` environment: find a hidden whole number from higher/lower answers.

Rules. A row holds the hidden number ``target`` and the range ``low``..``high`` (inclusive,
default 1..8). The episode opens with the user's message ``"Guess {low}-{high}."``, the same
for every target: nothing but the answers tells the model where the number is. After each of
the model's turns, its content read as a whole number:

* the hidden number: the episode ends, reward 1;
* another number in the range: the user answers ``"higher"`` (the hidden number is larger) or
  ``"lower"``, reward 0, and the model guesses again (the run's ``max_turns`` caps the guesses);
* anything else (not a whole number, or one outside the range): the episode ends with reward
  ``INVALID_REWARD`` (-1).

So an episode's reward (``environment_reward``, the sum of its steps') is 1 when the model
finds the number within its turns, 0 when its guesses run out, -1 when it leaves the format. The
penalty sits below a lost game on purpose: at 0, a policy that drifted into long strings of
digits scored as much as one that guessed and lost, and RL runs on the tiny demo model drifted
there and died (every episode of every group scored alike, so no gradient was left).

``GuessNumberBlind`` answers every wrong guess with ``"wrong"``: the same game without the
direction, the control that shows what reading the answers is worth.
"""

import re

from grpo_fast.environments.protocol import Environment, EnvStep

INVALID_REWARD = -1.0  # an answer that is not a guess in range
_GUESS = re.compile(r"\s*(-?\d+)\s*")


def prompt_of(low: int, high: int) -> str:
    """The episode's opening user message for the range ``low``..``high``."""
    return f"Guess {low}-{high}."


class GuessNumber(Environment):
    """One game: ``reset(row)`` reads ``row["target"]`` (and ``row["low"]``, ``row["high"]``,
    default 1 and 8; ValueError for a target outside them); ``step`` answers each guess as the
    module's docstring says. ``guesses``: the valid guesses so far."""

    feedback = True  # answer higher/lower; False: "wrong" (GuessNumberBlind)

    def reset(self, row: dict) -> list:
        self.low, self.high = int(row.get("low", 1)), int(row.get("high", 8))
        self.target = int(row["target"])
        if not self.low <= self.target <= self.high:
            raise ValueError(f"guess_number: target {self.target} is outside the range {self.low}..{self.high}")
        self.guesses: list = []
        return [{"role": "user", "content": prompt_of(self.low, self.high)}]

    def step(self, message: dict) -> EnvStep:
        match = _GUESS.fullmatch(message.get("content") or "")
        guess = None if match is None else int(match.group(1))
        if guess is None or not self.low <= guess <= self.high:
            return EnvStep([], True, INVALID_REWARD)
        self.guesses.append(guess)
        if guess == self.target:
            return EnvStep([], True, 1.0)
        answer = ("higher" if self.target > guess else "lower") if self.feedback else "wrong"
        return EnvStep([{"role": "user", "content": answer}], False, 0.0)


class GuessNumberBlind(GuessNumber):
    """The control: every wrong guess is answered ``"wrong"`` (no direction)."""

    feedback = False
