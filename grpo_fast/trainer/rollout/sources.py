"""Rollout sources: where a step's samples come from.

A source is the seam for *where* sampling runs; an engine (``engines/``) is the seam for
*how*. The trainer asks its source for the next batch from its data position, and hands it the
new weights after each optimizer step:

    samples = source.next(position, version)     # Samples; samples.data_end: the next position
    ...train on them...
    source.publish(policy, version + 1)          # after the optimizer step

Two sources exist: :class:`InProcessRollouts` samples in the trainer's process when asked
(the synchronous loop), and ``AsyncRollouts`` (``worker.py``) samples in a worker
process ahead of the trainer (``max_staleness`` >= 1). Either returns the same kind of
:class:`~grpo_fast.trainer.rollout.samples.Samples`, so the step never asks which one it has.
"""

import contextlib

import torch

from grpo_fast.trainer import distributed
from grpo_fast.trainer.rollout.samples import Samples, concat_samples, groups_with_signal, rollout, select_groups


class RolloutSource:
    """What the trainer needs of a source; subclasses implement :meth:`next` and override the
    rest where they have something to do."""

    def next(self, position: int, version: int) -> Samples:
        """This rank's share of the next batch: the groups of prompts from data position
        ``position`` on, sampled with weights at most ``max_staleness`` optimizer steps older
        than ``version`` (the trainer's weights now)."""
        raise NotImplementedError

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """``policy``'s weights are at ``version`` (optimizer steps) now."""

    def metrics(self) -> dict:
        """The source's share of the step's log line (timings, staleness), reset on read."""
        return {}

    def close(self) -> None:
        """Stops what the source runs (a worker process, an engine's core); a source may be asked
        again after."""


class InProcessRollouts(RolloutSource):
    """Samples with ``engine`` in this process when asked. With dynamic sampling (DAPO) a
    group whose rewards are all equal is dropped (its advantages are 0: no signal) and another
    round of prompts is sampled, until the batch is full or ``max_sampling_rounds`` rounds ran;
    surplus groups of the last round are left out. The batch may then hold fewer groups, or none.

    Args:
        engine: the :class:`~grpo_fast.trainer.rollout.engines.Generator`.
        data: the run's :class:`~grpo_fast.trainer.rollout.data.DataOrder`.
        reward_funcs: the reward functions.
        config: the run's config (group_size, dynamic_sampling, max_sampling_rounds, reward_weights).
        runtime: the run's runtime (its ranks).
        policy_module: the module an FSDP2 policy is gathered from for an engine that runs
            the policy itself.
        tokenizer: its pad token re-pads rounds to one width.
        turn_loop: with tools or an environment, the :class:`~grpo_fast.trainer.rollout.turns.TurnLoop` of the
            rollouts' turns; None without.
    """

    def __init__(self, engine, data, reward_funcs: list, config, runtime, policy_module, tokenizer, turn_loop=None):
        self.engine, self.data, self.reward_funcs, self.config = engine, data, reward_funcs, config
        self.ranks, self.policy_module, self.tokenizer = runtime.ranks, policy_module, tokenizer
        self.turn_loop = turn_loop

    def next(self, position: int, version: int) -> Samples:
        config, G, wanted = self.config, self.config.group_size, self.config.rollout.prompts_per_step
        rounds_allowed = config.max_sampling_rounds if config.dynamic_sampling else 1
        parts, kept, dropped, rounds = [], 0, 0, 0  # kept, dropped: groups over every rank
        while kept < wanted and rounds < rounds_allowed:
            rows, keys, position = self.data.take(position)
            gather = distributed.gathered(self.policy_module) if self.engine.runs_policy else contextlib.nullcontext()
            with gather:
                part = rollout(self.engine, rows, keys, self.reward_funcs, group_size=G, turns=self.turn_loop)
            rounds += 1
            if config.dynamic_sampling:
                # Every rank's groups of the round in data order, so that all ranks keep the same
                # first groups with a signal that a single process would.
                signal, first = self.ranks.gather_rows(groups_with_signal(part.rewards, G, config.reward_weights))
                dropped += int((~signal).sum())
                chosen = signal.nonzero().squeeze(1)[: wanted - kept]
                kept += len(chosen)
                part = select_groups(part, chosen[(chosen >= first) & (chosen < first + len(rows))] - first, G)
            else:
                kept = wanted
            parts.append(part)
        samples = concat_samples(parts, self.tokenizer.pad_token_id)
        samples.data_end, samples.sampling_rounds, samples.dropped_groups = position, rounds, dropped
        return samples

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        self.engine.publish(version)

    def metrics(self) -> dict:
        return {**self.engine.metrics(), **(self.turn_loop.metrics() if self.turn_loop else {})}

    def close(self) -> None:
        self.engine.close()
