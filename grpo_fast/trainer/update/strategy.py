"""The step's strategy: where the loss's advantages come from, and what trains beside the policy.

    GRPOTrainer(config, strategy=...)     one object, handed to the trainer; this base is GRPO's

The step calls it at five points and nothing else of it:

    __init__   strategy.check(config, tools)     refuse the run before anything loads
               strategy.attach(trainer)          build its own modules, once the trainer is built
    prepare    strategy.prepare(batch)           the loss's advantages from the batch's rewards
    each pass  strategy.backward(batch)          its own loss term's backward, after the policy's
               its parts' optimizer steps        (the trainer's: clipped as the policy's, one
                                                 ``<name>_grad_norm`` each on the log line)
    log line   strategy.metrics(batch)           more of the step's log line

A checkpoint stores each of :meth:`Strategy.parts` under its name (weights and AdamW states as
``<name>.model.*`` and ``<name>.optimizer.*``, the LR schedule as ``<name>_scheduler``) and
a resume restores it, so a run with a strategy of its own resumes as exactly as GRPO's.
"""

from typing import NamedTuple

import torch

from grpo_fast.trainer.update.batch import StepBatch


class TrainedPart(NamedTuple):
    """A module that a strategy trains beside the policy, with its own optimizer and LR schedule."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


class Strategy:
    """GRPO's: each completion's advantage is its reward relative to its group's (the batch's
    group advantages, ``update/batch.py``), and nothing trains but the policy.

    A subclass changes what it needs; every method here is a no-op but for GRPO's advantages,
    which the batch already holds.
    """

    def check(self, config, tools) -> None:
        """Raises ValueError for a run (``config``, the ``tools`` passed to the trainer) this
        strategy cannot serve; called before anything loads."""

    def attach(self, trainer) -> None:
        """Builds what the strategy trains or reads from the trainer just built (its policy,
        config, runtime); called once, at the end of the trainer's ``__init__``."""

    def parts(self) -> dict:
        """The modules trained beside the policy, ``{name: TrainedPart}`` (the names are those of
        their checkpoint keys): GRPO's has none."""
        return {}

    def prepare(self, batch: StepBatch) -> StepBatch:
        """The step's batch with the advantages the loss reads: ``advantages`` [N], one per
        sequence, or [N, C], one per completion token; it may also narrow ``completion_mask``
        (and then ``num_items``, its count over every rank) to the tokens its loss counts, or
        return a subclass of StepBatch that carries what its own loss term reads. Called for a
        batch with rows (``batch.stats`` is not None)."""
        return batch

    def backward(self, batch: StepBatch) -> dict:
        """Backward of the strategy's own loss term over ``batch``, after the policy's, in every
        pass; returns its metrics (numbers or 0-dim tensors, averaged over the passes)."""
        return {}

    def metrics(self, batch: StepBatch) -> dict:
        """More of the log line of a step that made an update."""
        return {}
