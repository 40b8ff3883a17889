"""Run logs: one JSON line of metrics per step, a reward/KL plot and a short summary."""

import json
import math
import os

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
)
# Keys that depend on the machine's speed and load, not on the run's numbers.
TIMING_KEYS = ("tokens_per_s", "step_time_s", "peak_mem_bytes")


def metrics_path(output_dir: str) -> str:
    return os.path.join(output_dir, "metrics.jsonl")


def append_metrics(output_dir: str, metrics: dict) -> None:
    with open(metrics_path(output_dir), "a") as f:
        f.write(json.dumps(metrics) + "\n")
        f.flush()


def read_metrics(output_dir: str) -> list:
    path = metrics_path(output_dir)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(output_dir: str, last_step: int) -> None:
    """Drops lines logged after ``last_step`` (steps a resumed run will redo)."""
    kept = [m for m in read_metrics(output_dir) if m["step"] <= last_step]
    tmp = metrics_path(output_dir) + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in kept)
    os.replace(tmp, metrics_path(output_dir))


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
    return "\n".join(
        [
            f"steps: {len(history)} in {elapsed_s:.1f} s",
            f"reward (mean of first / last tenth of steps): {first:.3f} -> {last:.3f} ({last - first:+.3f})",
            f"tokens/s (median): {sorted(tokens)[len(tokens) // 2]:.0f}" if tokens else "tokens/s: -",
            f"outputs: {output_dir} (metrics.jsonl, reward.png, checkpoints/, final/)",
        ]
    )
