"""Scripted tool turns for the engines' turn loop: the tool-rollout and vLLM tests share them."""

from grpo_fast.trainer.rollout.engines import Turns


class ScriptedTurns(Turns):
    """Every turn that ends with ``stop`` or EOS is answered with ``suffix``, up to ``turns``
    answered turns a row, when the suffix fits in its room."""

    def __init__(self, stop: int, suffix: list, turns: int = 2):
        self.stop_token_ids, self.suffix, self.turns = [stop], suffix, turns
        self.answered, self.seen = {}, []

    def suffixes(self, rows, turns, room):
        out = []
        for row, turn, left in zip(rows, turns, room):
            self.seen.append((row, list(turn), left))
            ok = self.answered.get(row, 0) < self.turns and len(self.suffix) < left
            self.answered[row] = self.answered.get(row, 0) + ok
            out.append(list(self.suffix) if ok else None)
        return out
