"""The step's batch: what every training pass of a step reads, built once from its samples.

    batch = StepBatch(...)        rewards -> group advantages (every rank's rewards), the
                                  reference pass's log-probs, the packed micro-batches

Micro-batches are cut once by the token budget (``trainer/model/packing.py``; the layout is
``grpo_fast/packing/``'s) and serve the reference pass and every training pass
(``passes.py``). Under torchrun the group advantages are computed from every rank's rewards
(see ``trainer/distributed.py``).
"""

import dataclasses

import torch

from grpo_fast import group_advantages
from grpo_fast.outputs import GroupAdvantages
from grpo_fast.trainer import distributed
from grpo_fast.trainer.model.build import reference_context
from grpo_fast.trainer.model.packing import pack_rollout
from grpo_fast.trainer.rollout.samples import Samples


@dataclasses.dataclass
class StepBatch:
    """What every training pass of a step reads, built once from its :class:`Samples`.

    samples: the samples (tokens, masks, completions, rewards, sampling log-probs).
    micro_batches: this rank's rows packed (``packing.Packed`` each), cut once.
    completion_mask: [N, C] the tokens the loss counts: the model's sampled tokens, 0 on
        padding and on tool-result tokens (a multi-turn completion's tools' output, which the
        attention mask keeps as context: packing reads that); a strategy may narrow it
        (``update/strategy.py``). Every count of the loss (its normalisers, per-sequence means, KL,
        entropy, the sampling correction) and the logged completion length read it.
    scores: [N_global, 2 + K] every rank's [combined reward, completion length, each reward]
        rows, gathered once (the log line's); the combined reward is NaN where unscored.
    stats: this rank's rows' :class:`GroupAdvantages` (advantages [N], combined rewards [N],
        its groups' mean and std, the batch's frac_zero_std); None when no rank has a row
        (dynamic sampling kept none): the step makes no update.
    advantages: what the loss reads: [N], one per sequence (the group advantages, unless the
        run's strategy prepared others), or [N, C], one per completion token; None as ``stats``.
    ref_logprobs: [N, C] the reference's log-probs of the completions, or None (beta = 0).
    num_items: the active-token count of every rank's rows (a 0-dim tensor).
    """

    samples: Samples
    micro_batches: list
    completion_mask: torch.Tensor
    scores: torch.Tensor
    stats: GroupAdvantages | None
    advantages: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    num_items: torch.Tensor


def scores_and_advantages(samples: Samples, config, ranks, device: torch.device) -> tuple:
    """``(scores [N_global, 2 + K], this rank's GroupAdvantages on device or None)``: GRPO's
    advantages, each reward relative to its group's (no learned baseline). They are computed
    from every rank's rewards [N_global, K] (a few numbers a row; a group never spans ranks, but
    scale="batch" and the logged statistics are the global batch's); this rank keeps its rows.
    None when no rank has a row."""
    G, N = config.group_size, samples.rewards.shape[0]
    # The log line's completion_len_mean, travelling with the rewards: the model's tokens (tool
    # results not counted, as TRL's completions/mean_length counts sum(tool_mask)).
    lengths = samples.completion_mask.sum(1).to(samples.rewards)
    table, first = ranks.gather_rows(torch.cat([lengths[:, None], samples.rewards], 1))
    if len(table) == 0:
        return torch.cat([torch.full_like(table[:, :1], float("nan")), table], 1), None
    stats = group_advantages(table[:, 1:], G, scale=config.advantage_scale, reward_weights=config.reward_weights)
    rows, groups = slice(first, first + N), slice(first // G, (first + N) // G)
    mine = GroupAdvantages(
        stats.advantages[rows], stats.rewards[rows], stats.mean[groups], stats.std[groups], stats.frac_zero_std
    )
    return torch.cat([stats.rewards[:, None], table], 1), GroupAdvantages(*(t.to(device) for t in mine))


@torch.no_grad()
def packed_logprobs(module, micro_batches: list, ranks, filler, like: torch.Tensor) -> torch.Tensor:
    """The completion tokens' log-probs [n, C] under ``module`` of ``micro_batches`` (run in
    lockstep with the other ranks: under FSDP2 a forward is a collective); zeros like ``like``
    [n, C] when there are none."""
    out = []
    for packed, _ in ranks.lockstep(micro_batches):
        logp = module(filler if packed is None else packed)
        if packed is not None:
            out.append(logp)
    if distributed.is_sharded(module):
        module.reshard()  # no backward follows to reshard the root: free its whole weights now
    return torch.cat(out) if out else torch.zeros_like(like)


def reference_logprobs(module, policy, reference, samples: Samples, micro_batches: list, ranks, filler):
    """The reference's log-probs [N, C] of the samples: those a rollout worker computed ahead
    for the first rows (``samples.ref_logprobs``), then the other micro-batches'."""
    done = samples.ref_logprobs
    first = 0 if done is None else done.shape[0]
    rest = [packed for packed in micro_batches if packed.rows.start >= first]
    with reference_context(policy, reference):
        logp = packed_logprobs(module, rest, ranks, filler, samples.completion_mask[first:])
    return logp if done is None else torch.cat([done, logp])


def batch_fields(samples: Samples, config, modules, policy, reference, runtime) -> dict:
    """The fields of a step's :class:`StepBatch`: the samples' micro-batches packed once (the
    token budget), the reference's log-probs (``modules.reference``, None when beta = 0), the
    group advantages from every rank's rewards. ``policy``, ``reference``: the models behind
    the modules (a peft policy is its own reference, adapters off)."""
    ranks = runtime.ranks
    ranks.same_in_sequence_group(samples.input_ids, "rollouts")  # a group's ranks split the same rows' tokens
    C = samples.completion_mask.shape[1]
    micro = pack_rollout(samples.input_ids, samples.attention_mask, C, config, policy)
    ref = None
    if modules.reference is not None and ranks.sum(samples.input_ids.shape[0]):
        ref = reference_logprobs(modules.reference, policy, reference, samples, micro, ranks, modules.filler)
    scores, stats = scores_and_advantages(samples, config, ranks, runtime.device)
    return dict(
        samples=samples,
        micro_batches=micro,
        completion_mask=samples.completion_mask,
        scores=scores,
        stats=stats,
        advantages=None if stats is None else stats.advantages,
        ref_logprobs=ref,
        num_items=ranks.sum(samples.completion_mask.sum()),  # active tokens of the whole batch
    )
