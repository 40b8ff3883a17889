"""One training step's stages, each a function of values:

    samples  = source.next(position, version)       Samples   (sources.py, async_rollout.py)
    batch    = prepare(samples)                      StepBatch: rewards -> advantages, reference
                                                     log-probs, packed micro-batches; built once
    result   = accumulate(batch, proximal)           PassResult: the backward over every
                                                     micro-batch, its summed metrics and, on the
                                                     first pass, its log-probs and correction
    proximal = Proximal.of(result, batch, ...)       the first pass's log-probs: the later passes'
                                                     old log-probs, the correction's weights

The first pass runs at the weights the step starts with, so its log-probs are the proximal
(old) policy's: the later passes (num_iterations > 1) read them, and where the samples' own
log-probs differ from the trainer's (the vllm engine, a rollout worker's possibly stale batch)
the first pass applies the loss spec's ``sampling_correction`` of them against its own log-probs
micro-batch by micro-batch (``PackedPolicy``), which the later passes keep. No extra forward
computes either, where TRL runs one.

Every forward runs on packed sequences (``packing.py``: no padding computed, the LM head only
at completion positions), in micro-batches cut once by a token budget, weighted by the loss
spec so that the accumulated gradient equals the full-batch gradient for every loss type.
Under torchrun the group advantages are computed from every rank's rewards, the loss
normalisers and micro-batch weights from global row and token counts (see ``distributed.py``).
"""

import dataclasses

import torch

from grpo_fast import group_advantages
from grpo_fast.ops.policy import LossInputs
from grpo_fast.outputs import GroupAdvantages
from grpo_fast.spec import SAMPLING_CORRECTIONS
from grpo_fast.trainer import distributed
from grpo_fast.trainer.metrics import PASS_METRICS
from grpo_fast.trainer.packed_policy import Behaviour
from grpo_fast.trainer.packing import packed_attention, to_grid
from grpo_fast.trainer.rollout import Samples, reference_context, sampling_metrics


@dataclasses.dataclass
class StepBatch:
    """What every training pass of a step reads, built once from its :class:`Samples`.

    samples: the samples (tokens, masks, completions, rewards, sampling log-probs).
    micro_batches: this rank's rows packed (``packing.Packed`` each), cut once.
    completion_mask: [N, C] the tokens the loss counts: the model's sampled tokens, 0 on
        padding and on tool-result tokens (a multi-turn completion's tools' output, which the
        attention mask keeps as context: packing reads that); the PPO baseline leaves unscored
        completions out. Every count of the loss (its normalisers, per-sequence means, KL,
        entropy, the sampling correction) and the logged completion length read it.
    scores: [N_global, 2 + K] every rank's [combined reward, completion length, each reward]
        rows, gathered once (the log line's); the combined reward is NaN where unscored.
    stats: this rank's rows' :class:`GroupAdvantages` (advantages [N], combined rewards [N],
        its groups' mean and std, the batch's frac_zero_std); None when no rank has a row
        (dynamic sampling kept none): the step makes no update.
    advantages: [N] per sequence (GRPO), or [N, C] per token (PPO); None as ``stats``.
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


@dataclasses.dataclass
class PassResult:
    """One training pass: its summed metrics (device tensors, this rank's shares), and on a
    pass asked to record them, the policy's log-probs [N, C] and the sampling correction's
    weights [N, C] and bounded ratios ([N, C], or [N, 1] for a sequence mode)."""

    metrics: dict
    logprobs: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    ratio: torch.Tensor | None = None


@dataclasses.dataclass
class Proximal:
    """The first pass's view of the batch, which the step's later passes use.

    logprobs: [N, C] the policy's log-probs at the weights the step started with.
    importance_weights: [N, C] the sampling correction's weights, or None (no correction).
    metrics: TRL's ``sampling/*`` metrics of the correction (0-dim device tensors), or {}.
    """

    logprobs: torch.Tensor
    importance_weights: torch.Tensor | None
    metrics: dict

    @classmethod
    def of(cls, first: PassResult, batch: StepBatch, correction: dict | None, ranks) -> "Proximal":
        """From the first pass's record; the correction's metrics over every rank's tokens."""
        if first.weights is None:
            return cls(first.logprobs, None, {})
        sequence_level = SAMPLING_CORRECTIONS[correction["mode"]][0] == "sequence"
        behaviour = batch.samples.sampling_logprobs
        metrics = sampling_metrics(first.logprobs, behaviour, batch.completion_mask, first.ratio, sequence_level, ranks)
        return cls(first.logprobs, first.weights, metrics)


def corrects(samples: Samples, correction: dict | None) -> bool:
    """Whether the loss corrects for the samples' own log-probs (they exist and the run corrects)."""
    return samples.sampling_logprobs is not None and correction is not None


def scores_and_advantages(samples: Samples, config, ranks, device: torch.device) -> tuple:
    """``(scores [N_global, 2 + K], this rank's GroupAdvantages on device or None)``: GRPO's
    critic-free advantages, each reward relative to its group's. They are computed from every
    rank's rewards [N_global, K] (a few numbers a row; a group never spans ranks, but
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


def accumulate(modules, policy, batch: StepBatch, proximal: Proximal | None, config, ranks, record: bool):
    """Backward over the batch's packed micro-batches: the summed gradient is the full batch's.
    Each micro-batch's loss is weighted by the loss type's aggregation (the loss spec) over the
    global batch's row and token counts, times the world size, since DDP and FSDP2 average
    gradients over ranks. A rank with fewer micro-batches than another runs fillers (loss
    times 0) so that the ranks' collectives match. Nothing is read to the host.

    ``proximal``: the first pass's view (later passes), or None (the first pass). ``record``:
    keep the log-probs (and apply and keep the sampling correction where the samples need it).
    Returns a :class:`PassResult`: the loss and the token-weighted means of the loss metrics
    over the global batch, as this rank's shares (summed over ranks when read)."""
    loss_config, correction = modules.packed.loss_config, config.correction_options()
    behaviour = record and corrects(batch.samples, correction)
    mask = batch.completion_mask
    # Counts in float64, as Python's numbers were: the weights must not round the gradient.
    tokens = mask.sum(1, dtype=torch.float64)  # [N]
    total_rows = ranks.sum(tokens.new_tensor(float(mask.shape[0])))
    total_tokens = num_items = torch.as_tensor(batch.num_items, dtype=torch.float64, device=tokens.device)
    sums = dict.fromkeys(PASS_METRICS, 0.0)
    # Metrics are means over active tokens, but with sequence-level ratios the clip flags are
    # means over sequences: each micro-batch's value counts by its share of those.
    by_rows = {key for key in PASS_METRICS if key.startswith("clip")}
    by_rows = by_rows if loss_config.importance_sampling == "sequence" else set()
    logprobs, corrections = [], []
    for packed, sync in ranks.lockstep(batch.micro_batches):
        # The packed attention holds through the backward: gradient checkpointing recomputes
        # each layer's forward there, and must attend as the forward did.
        with distributed.gradient_sync(modules.train, sync), packed_attention(policy):
            if packed is None:
                (modules.train(modules.filler).sum() * 0.0).backward()
                continue
            rows = packed.rows
            micro_tokens = tokens[rows].sum()
            token_share = micro_tokens / total_tokens.clamp(min=1.0)
            row_share = (rows.stop - rows.start) / total_rows
            weight = loss_config.aggregation.micro_batch_weight(
                rows.stop - rows.start, micro_tokens, total_rows, total_tokens, loss_config, num_items
            )
            sampled = Behaviour(batch.samples.sampling_logprobs[rows], mask[rows], correction) if behaviour else None
            inputs = loss_inputs(batch, packed, proximal, config.num_iterations, num_items)
            out = modules.train(packed, inputs, fused_linear=config.fused_linear, behaviour=sampled)
            (out.loss.loss * (weight * ranks.world_size)).backward()
        if record:
            logprobs.append(to_grid(out.logprobs.unsqueeze(0), packed))
            corrections.extend([out.correction] if behaviour else [])
        sums["loss"] = sums["loss"] + out.loss.loss.detach() * weight
        for key in PASS_METRICS[1:]:
            value, share = getattr(out.loss, key), row_share if key in by_rows else token_share
            sums[key] = None if value is None or sums[key] is None else sums[key] + value * share
    if not record:
        return PassResult(sums)
    logprobs = torch.cat(logprobs) if logprobs else torch.zeros_like(mask)
    if not behaviour:
        return PassResult(sums, logprobs)
    if not corrections:  # no rows on this rank
        width = 1 if SAMPLING_CORRECTIONS[correction["mode"]][0] == "sequence" else mask.shape[1]
        return PassResult(sums, logprobs, torch.zeros_like(mask), mask.new_zeros(0, width))
    weights, ratio = (torch.cat(parts) for parts in zip(*corrections))
    return PassResult(sums, logprobs, weights, ratio)


def loss_inputs(batch: StepBatch, packed, proximal: Proximal | None, num_iterations: int, num_items) -> LossInputs:
    """The loss's per-token inputs of one packed micro-batch, gathered from the batch's [N, C]
    grids to its flat tokens [Nc]: advantages, mask, old log-probs (the proximal ones when the
    step makes several passes), reference log-probs, the correction's weights."""
    rows, (row, col) = packed.rows, packed.grid

    def tokens(x):  # [n, C] -> [Nc]
        return None if x is None else x[rows][row, col]

    advantages = batch.advantages[rows]  # [n] per sequence, or [n, C] (PPO)
    old = proximal.logprobs if proximal is not None and num_iterations > 1 else None
    return LossInputs(
        advantages.unsqueeze(1) if advantages.dim() == 1 else tokens(batch.advantages),
        tokens(batch.completion_mask),
        tokens(old),
        tokens(batch.ref_logprobs),
        tokens(None if proximal is None else proximal.importance_weights),
        num_items_in_batch=num_items,
        cu_seqlens=packed.completion_cu_seqlens,
    )
