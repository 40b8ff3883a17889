"""The step's log line: every statistic the device holds read to the host at once, over every
rank's rows (timings are rank 0's, memory the largest rank's)."""

import math
import resource
import time

import torch

# The loss and the loss metrics that each backward pass logs (LossOutput's fields but ratio_mean).
PASS_METRICS = ("loss", "kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy")
# What the passes count: the log line sums these over a step's passes (the rest are means).
PASS_COUNTS = ("nonfinite_steps",)


def read_metrics(passes: list, ranks, device: torch.device) -> list:
    """The passes' metrics (dicts of 0-dim device tensors, numbers or None) as numbers, in
    one host read: the loss metrics (``PASS_METRICS``) summed over ranks, the others (the
    gradient norms) as they are; a loss metric is None when it is None on any rank."""
    keys = [(i, key) for i, metrics in enumerate(passes) for key in metrics]
    if not keys:
        return [{} for _ in passes]

    def entry(value):  # [value, is None], float64 on the device
        if not torch.is_tensor(value):
            values = [0.0 if value is None else float(value), float(value is None)]
            return torch.tensor(values, dtype=torch.float64, device=device)
        return torch.nn.functional.pad(value.detach().to(device, torch.float64).reshape(1), (0, 1))

    table = torch.stack([entry(passes[i][key]) for i, key in keys])  # [entries, 2]
    if ranks.world_size > 1:
        summed = torch.tensor([key in PASS_METRICS for _, key in keys], device=device)
        table = torch.where(summed[:, None], ranks.sum(table), table)
    out = [{} for _ in passes]
    for (i, key), (value, none) in zip(keys, table.tolist()):
        out[i][key] = None if none else value
    return out


def _tool_metrics(counts, rows: int, ranks) -> dict:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed
    calls per call), and the mean turns per trajectory, over every rank's ``rows`` completions,
    from each row's ``counts`` [n, 3] (calls, failures, turns); {} without tools."""
    if counts is None:
        return {}
    calls, failures, turns = ranks.sum(counts.sum(0).double())
    return {
        "tools/call_frequency": calls / rows,
        "tools/failure_frequency": failures / calls.clamp(min=1),
        "tools/turns_mean": turns / rows,
    }


def _env_metrics(counts, rows: int, ranks) -> dict:
    """The environment's episodes over every rank's ``rows``: env/turns_mean (the model's turns
    per episode), env/errors (episodes an error ended) and env/success (the share of scored
    episodes whose reward reached eval_pass_threshold; NaN when none was scored), from each
    row's ``counts`` [n, 4] (turns, errors, successes, scored); {} without an environment."""
    if counts is None:
        return {}
    turns, errors, successes, scored = ranks.sum(counts.sum(0).double())
    return {"env/turns_mean": turns / rows, "env/errors": errors, "env/success": successes / scored}


class PhaseClock:
    """The seconds of a step's stages, read with its log line and never before: on CPU the host
    clock at each :meth:`mark`, on CUDA an event recorded on the stream there (no wait), so a
    stage's kernels count for it even though the host runs ahead; the log line's one host read
    is after the last mark, so every event has happened by :meth:`seconds`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()
        self.marks = [("start", self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, stage: str) -> None:
        """The stage ``stage`` ends here (it began at the previous mark)."""
        self.marks.append((stage, self._now()))

    def seconds(self) -> dict:
        """``{"time/<stage>_s": seconds}`` of each marked stage."""
        out = {}
        for (_, begin), (stage, end) in zip(self.marks, self.marks[1:]):
            out[f"time/{stage}_s"] = begin.elapsed_time(end) / 1e3 if self.cuda else end - begin
        return out


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak of this step, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def log_line(
    step: int,
    batch,
    passes: list,
    clock: PhaseClock,
    runtime,
    *,
    learning_rate: float,
    extra: dict,
    sampling: dict,
    dynamic_sampling: bool,
    reward_names: list,
) -> dict:
    """The step's log line, over every rank's rows: rollout statistics, the mean of each pass
    metric over the num_iterations passes (None when the step made no update), throughput and
    memory, the learning rate, ``extra``, TRL's ``sampling/*`` metrics of the correction, the
    dynamic sampling counts and the per-reward means. Everything the device holds is read to
    the host at once; the step's time (from ``clock.start``) ends there, and the stages'
    seconds (``time/rollout_s``, ``time/prepare_s``, ``time/update_s``) are read from ``clock``.

    Args:
        batch: the step's :class:`~grpo_fast.trainer.update.batch.StepBatch`.
        passes: each pass's metrics (device tensors).
        extra: the source's and the strategy's metrics (staleness, waits; ``update/strategy.py``).
        sampling: the sampling correction's metrics (device tensors), or {}.
    """
    ranks, table = runtime.ranks, batch.scores  # [N_global, 2 + K]: combined reward, length, each reward
    combined, lengths, rewards = table[:, 0], table[:, 1], table[:, 2:]
    scored = ~combined.isnan()  # completions no reward function scored are left out, as TRL
    count = scored.sum()
    mean = combined.nan_to_num().sum() / count
    variance = ((combined - mean).nan_to_num() ** 2).sum() / (count - 1)
    stats = dict(
        scored=count,
        reward_mean=mean,
        reward_std=variance.sqrt(),
        frac_reward_zero_std=None if batch.stats is None else batch.stats.frac_zero_std,
        completion_len_mean=lengths.mean(),
        tokens=ranks.sum(batch.samples.attention_mask.sum()),
        # what one pass runs through the model's body: fewer than tokens with shared_prefix
        forward_tokens=ranks.sum(  # a tensor: summed over ranks without a host read of its own
            torch.tensor(sum(p.input_ids.shape[1] for p in batch.micro_batches), device=runtime.device)
        ),
        **{f"rewards/{name}": rewards[:, k].nanmean() for k, name in enumerate(reward_names)},
        **sampling,
        **_tool_metrics(batch.samples.tool_counts, len(table), ranks),
        **_env_metrics(batch.samples.env_counts, len(table), ranks),
    )
    *passes, stats = read_metrics([*passes, stats], ranks, runtime.device)
    elapsed = time.perf_counter() - clock.start
    metrics = dict(
        step=step,
        reward_mean=stats["reward_mean"] if stats["scored"] else None,
        reward_std=stats["reward_std"] if stats["scored"] > 1 else None,
        frac_reward_zero_std=stats["frac_reward_zero_std"],
    )
    for key in passes[0] if passes else PASS_METRICS:
        values = [p[key] for p in passes]
        metrics[key] = None if None in values or not values else sum(values) / len(values)
    metrics.update({key: int(sum(p[key] for p in passes)) for key in PASS_COUNTS})  # 0 for a step without update
    metrics.update(
        completion_len_mean=stats["completion_len_mean"] if len(lengths) else None,
        tokens_per_s=stats["tokens"] / elapsed,
        forward_tokens=stats["forward_tokens"],
        prefix_saved=1 - stats["forward_tokens"] / stats["tokens"] if stats["tokens"] else 0.0,
        step_time_s=elapsed,
        peak_mem_bytes=ranks.max(peak_memory(runtime.device)),
        learning_rate=learning_rate,
        **clock.seconds(),
        **extra,
        **{key: stats[key] for key in sampling},
    )
    turn_keys = [key for key in stats if key.startswith(("tools/", "env/"))]
    metrics.update({key: None if math.isnan(stats[key]) else stats[key] for key in turn_keys})
    if "env/errors" in metrics:
        metrics["env/errors"] = int(metrics["env/errors"])
    if dynamic_sampling:
        metrics.update(sampling_rounds=batch.samples.sampling_rounds, groups_dropped=batch.samples.dropped_groups)
    for name in reward_names:
        value = stats[f"rewards/{name}"]
        metrics[f"rewards/{name}"] = None if math.isnan(value) else value
    return metrics
