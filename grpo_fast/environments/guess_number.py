"""The built-in ``guess_number`` environment: find a hidden whole number from higher/lower answers.

Rules. A row holds the hidden number ``target`` and the range ``low``..``high`` (inclusive,
default 1..8). The episode opens with the user's message ``"Guess my number from {low} to
{high}."`` (the same for every target, so nothing but the answers tells the model where it
is). After each of the model's turns, its content read as a whole number:

* the hidden number: the episode ends, reward 1;
* another number: the user answers ``"higher"`` (the hidden number is larger) or ``"lower"``,
  reward 0, and the model guesses again (the run's ``max_turns`` caps the guesses);
* anything else: the episode ends, reward 0.

So the episode's reward (``environment_reward``) is 1 when the model finds the number within
its turns, else 0. ``GuessNumberBlind`` answers every wrong guess with ``"wrong"``: the same
game without the information, the control that shows what reading the answers is worth.
"""

import re

from grpo_fast.environments.protocol import Environment, EnvStep

_GUESS = re.compile(r"\s*(-?\d+)\s*")


def prompt_of(low: int, high: int) -> str:
    """The episode's opening user message for the range ``low``..``high``."""
    return f"Guess my number from {low} to {high}."


class GuessNumber(Environment):
    """One game: ``reset(row)`` reads ``row["target"]`` (and ``row["low"]``, ``row["high"]``,
    default 1 and 8); ``step`` answers each guess as the module's docstring says."""

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
        if match is None:
            return EnvStep([], True, 0.0)
        guess = int(match.group(1))
        self.guesses.append(guess)
        if guess == self.target:
            return EnvStep([], True, 1.0)
        answer = ("higher" if self.target > guess else "lower") if self.feedback else "wrong"
        return EnvStep([{"role": "user", "content": answer}], False, 0.0)


class GuessNumberBlind(GuessNumber):
    """The control: every wrong guess is answered ``"wrong"`` (no direction)."""

    feedback = False
