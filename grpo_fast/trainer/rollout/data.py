"""The run's data order: which prompt rows a step samples, as a function of a position.

Positions count prompts from the run's start. Each epoch is a fresh seeded shuffle of the rows,
so a position alone says where the order is, and a checkpoint that stores it resumes there.
Every rank walks the same order and takes its contiguous share of each step's prompts.
"""

import random


class DataOrder:
    """The order of ``rows`` for a run seeded ``seed``, taken ``prompts_per_step`` at a time.

    Args:
        rows: the prompt rows ``{"prompt": str, ...}``.
        seed: the run's seed (each epoch's shuffle derives from it).
        prompts_per_step: the prompts of one step over every rank.
        ranks: this process's place in the job (its share of each step's prompts).
    """

    def __init__(self, rows: list, seed: int, prompts_per_step: int, ranks):
        self.rows, self.seed, self.prompts_per_step, self.ranks = rows, seed, prompts_per_step, ranks
        self._epoch = (None, None)  # the last epoch's order: (epoch, order)

    def take(self, position: int) -> tuple:
        """``(rows, keys, end)``: this rank's share of the prompts_per_step rows from
        ``position`` on, their positions (the keys of their samples), and the position after them."""
        keys = list(range(position, position + self.prompts_per_step))
        rows = [self.rows[self._order(key // len(self.rows))[key % len(self.rows)]] for key in keys]
        mine = self.ranks.share(len(rows))
        return rows[mine], keys[mine], keys[-1] + 1

    def _order(self, epoch: int) -> list:
        if self._epoch[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1]
