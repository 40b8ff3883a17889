"""Run logs: one JSON line of metrics per step, a sample of completions every few steps, a
reward/KL plot and a short summary."""

import json
import math
import os

import torch

METRIC_KEYS = (
    "step",
    "reward_mean",
    "reward_std",
    "frac_reward_zero_std",
    "loss",
    "kl",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_region",
    "entropy",
    "completion_len_mean",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_bytes",
    "nonfinite_steps",
)
# Rows of each completions sample (completions.jsonl), spread over the batch's groups.
COMPLETION_ROWS = 16
# Keys that depend on the machine's speed and load, not on the run's numbers.
TIMING_KEYS = (
    "tokens_per_s",
    "step_time_s",
    "peak_mem_bytes",
    "sync_time_s",
    "tools/seconds",
    "env/seconds",
    # the step's stages: sampling and scoring, the batch (packing, advantages, reference pass),
    # the backward passes and optimizer steps (update/metrics.py's PhaseClock)
    "time/rollout_s",
    "time/prepare_s",
    "time/update_s",
    # asynchronous rollouts' waits and copies
    "rollout_wait_s",
    "worker_rollout_s",
    "worker_weight_wait_s",
    "weight_copy_s",
    # the share of the reference pass the worker had time for before the trainer asked
    "worker_reference_share",
)


def due(step: int, every: int, last: int) -> bool:
    """Whether a thing logged every ``every`` steps (0 = never) runs after step ``step`` of ``last``."""
    return every > 0 and (step % every == 0 or step == last)


def metrics_path(output_dir: str) -> str:
    return os.path.join(output_dir, "metrics.jsonl")


def append_metrics(output_dir: str, metrics: dict) -> None:
    with open(metrics_path(output_dir), "a") as f:
        f.write(json.dumps(metrics) + "\n")
        f.flush()


def _read_jsonl(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(output_dir: str) -> list:
    return _read_jsonl(metrics_path(output_dir))


def read_completions(output_dir: str) -> list:
    return _read_jsonl(completions_path(output_dir))


def truncate_metrics(output_dir: str, last_step: int) -> None:
    """Drops the metrics and completions lines logged after ``last_step`` (steps a resumed run will redo)."""
    for path in (metrics_path(output_dir), completions_path(output_dir)):
        if os.path.exists(path):
            kept = [m for m in _read_jsonl(path) if m["step"] <= last_step]
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in kept)
            os.replace(path + ".tmp", path)


def completions_path(output_dir: str) -> str:
    return os.path.join(output_dir, "completions.jsonl")


def completion_rows(batch, step: int, reward_names: list, max_rows: int = COMPLETION_ROWS) -> list:
    """Up to ``max_rows`` rows of a step's batch (``step.StepBatch``, with advantages), spread
    evenly over its groups: ``{"step", "prompt", "completion", "reward", <each reward
    function>, "advantage"}`` (per-token advantages [N, C], a strategy's, as their mean over
    the completion's tokens; None for NaN)."""
    advantages, samples = batch.advantages, batch.samples
    if advantages.dim() == 2:
        mask = batch.completion_mask.to(advantages.device)
        advantages = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
    N = len(samples.completions)
    picks = range(0, N, max(1, math.ceil(N / max_rows)))
    table = torch.cat([batch.stats.rewards[:, None].cpu(), samples.rewards.cpu(), advantages[:, None].cpu()], 1)

    def number(x: float):
        return None if math.isnan(x) else x

    rows = []
    for i in picks:
        values = [number(x) for x in table[i].tolist()]
        rows.append(
            dict(
                step=step,
                prompt=samples.prompts[i],
                completion=samples.completions[i],
                reward=values[0],
                **{name: value for name, value in zip(reward_names, values[1:-1])},
                advantage=values[-1],
            )
        )
    return rows


def append_completions(output_dir: str, rows: list) -> None:
    with open(completions_path(output_dir), "a") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def tenth_means(history: list, key: str = "reward_mean") -> tuple:
    """Mean of ``key`` over the first and the last tenth of the steps (at least one step each)."""
    values = [m[key] for m in history if m.get(key) is not None]
    if not values:
        return math.nan, math.nan
    n = max(1, len(values) // 10)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def plot_rewards(history: list, path: str) -> str | None:
    """Reward (and KL when logged) per step to a PNG; returns the path, or None without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: the caller's plotting backend is left alone
    except ImportError:
        return None
    steps = [m["step"] for m in history]
    has_kl = any(m.get("kl") is not None for m in history)
    fig = Figure(figsize=(10 if has_kl else 5, 3.5))
    axes = fig.subplots(1, 2 if has_kl else 1, squeeze=False)
    ax = axes[0, 0]
    ax.plot(steps, [math.nan if m["reward_mean"] is None else m["reward_mean"] for m in history], label="reward mean")
    evaluated = [m for m in history if "eval/reward_mean" in m]
    for key, label in (("eval/reward_mean", "eval reward mean"), ("eval/pass@1", "eval pass@1")):
        if evaluated:
            values = [math.nan if m[key] is None else m[key] for m in evaluated]
            ax.plot([m["step"] for m in evaluated], values, marker="o", label=label)
    if evaluated:
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if has_kl:
        ax = axes[0, 1]
        ax.plot(steps, [m["kl"] if m.get("kl") is not None else math.nan for m in history], color="tab:red")
        ax.set_xlabel("step")
        ax.set_ylabel("KL to reference")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def summary(history: list, output_dir: str, elapsed_s: float) -> str:
    """A few lines: reward at the start and end, time, where the outputs are."""
    first, last = tenth_means(history)
    tokens = [m["tokens_per_s"] for m in history]
    evaluated = [m for m in history if "eval/reward_mean" in m]
    lines = [
        f"steps: {len(history)} in {elapsed_s:.1f} s",
        f"reward (mean of first / last tenth of steps): {first:.3f} -> {last:.3f} ({last - first:+.3f})",
        f"tokens/s (median): {sorted(tokens)[len(tokens) // 2]:.0f}" if tokens else "tokens/s: -",
    ]
    if evaluated:
        end = evaluated[-1]
        lines.append(
            f"eval at step {end['step']}: "
            + ", ".join(
                f"{key[5:]} {value:.3f}" for key, value in end.items() if key.startswith("eval/") and value is not None
            )
        )
    lines.append(f"outputs: {output_dir} (metrics.jsonl, completions.jsonl, reward.png, checkpoints/, final/)")
    return "\n".join(lines)
