"""A training pass, and what the step's first pass leaves for the others:

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

Every forward runs on packed sequences (``grpo_fast/packing/``: no padding computed, the
LM head only at completion positions), weighted by the loss spec so that the accumulated
gradient equals the full-batch gradient for every loss type. Under torchrun the loss
normalisers and micro-batch weights come from global row and token counts.
"""

import dataclasses
import math

import torch

from grpo_fast.ops.policy import LossInputs
from grpo_fast.packing import to_grid
from grpo_fast.spec import SAMPLING_CORRECTIONS
from grpo_fast.trainer import distributed
from grpo_fast.trainer.model.packed_policy import Behaviour
from grpo_fast.trainer.rollout.samples import Samples
from grpo_fast.trainer.update.batch import StepBatch
from grpo_fast.trainer.update.metrics import PASS_METRICS


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


def sampling_metrics(proximal, behaviour, mask, ratio, sequence_level: bool, ranks) -> dict:
    """TRL's ``sampling/*`` metrics of a sampling correction over every rank's rows, as 0-dim
    float64 tensors on the rows' device (read with the step's other metrics): the mean and
    largest |proximal - behaviour| over completion tokens (NaN left out), and the smallest, mean
    and largest bounded ratio [N, T] over tokens, or [N, 1] over sequences (0 when none)."""
    active = mask.bool()
    diff = (proximal - behaviour).abs()
    valid = active & ~diff.isnan()
    counted = torch.ones_like(ratio, dtype=torch.bool) if sequence_level else active

    def total(x, keep):
        return x.where(keep, 0.0).sum().double()

    def largest(x, keep):  # -inf where nothing is kept (a rank without rows)
        return torch.cat([x.where(keep, -math.inf).flatten(), x.new_full((1,), -math.inf)]).max().double()

    sums = ranks.sum(
        torch.stack([total(diff, valid), valid.sum().double(), total(ratio, counted), counted.sum().double()])
    )
    highs = ranks.max(torch.stack([largest(diff, valid), largest(ratio, counted), largest(-ratio, counted)]))
    any_diff, any_ratio = sums[1] > 0, sums[3] > 0
    return {
        "sampling/sampling_logp_difference/mean": sums[0] / sums[1].clamp(min=1),
        "sampling/sampling_logp_difference/max": torch.where(any_diff, highs[0], 0.0),
        "sampling/importance_sampling_ratio/min": torch.where(any_ratio, -highs[2], 0.0),
        "sampling/importance_sampling_ratio/mean": sums[2] / sums[3].clamp(min=1),
        "sampling/importance_sampling_ratio/max": torch.where(any_ratio, highs[1], 0.0),
    }


def accumulate(modules, batch: StepBatch, proximal: Proximal | None, config, ranks, record: bool):
    """Backward over the batch's packed micro-batches: the summed gradient is the full batch's.
    Each micro-batch's loss is weighted by the loss type's aggregation (the loss spec) over the
    global batch's row and token counts, times the world size, since DDP and FSDP2 average
    gradients over ranks. A rank with fewer micro-batches than another runs fillers (loss
    times 0) so that the ranks' collectives match. Nothing is read to the host.

    ``proximal``: the first pass's view (later passes), or None (the first pass). ``record``:
    keep the log-probs (and apply and keep the sampling correction where the samples need it).
    Returns a :class:`PassResult`: the loss and the token-weighted means of the loss metrics
    over the global batch, as this rank's shares (summed over ranks when read)."""
    loss_config, correction = modules.packed.loss_config, config.async_.correction_options()
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
        with distributed.gradient_sync(modules.train, sync):
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
    grids to its flat tokens [Nc]: advantages (a sequence's [N] as [n, 1], broadcast over its
    tokens), mask, old log-probs (the proximal ones when the step makes several passes),
    reference log-probs, the correction's weights."""
    rows, (row, col) = packed.rows, packed.grid

    def tokens(x):  # [n, C] -> [Nc]
        return None if x is None else x[rows][row, col]

    old = proximal.logprobs if proximal is not None and num_iterations > 1 else None
    advantages = batch.advantages
    return LossInputs(
        tokens(advantages) if advantages.dim() == 2 else advantages[rows].unsqueeze(1),
        tokens(batch.completion_mask),
        tokens(old),
        tokens(batch.ref_logprobs),
        tokens(None if proximal is None else proximal.importance_weights),
        num_items_in_batch=num_items,
        cu_seqlens=packed.completion_cu_seqlens,
    )
