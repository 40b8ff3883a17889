"""The run around the steps: the config and metrics files, trackers, the progress bar, the
evaluation and completion cadence, checkpoints, the final model and its card, the reward plot
and the push to the Hub; preemption, non-finite steps and failed saves (``faults.py``)."""

import logging
import os
import time

from grpo_fast.trainer.run import checkpoint, faults, hub, run_log, trackers

logger = logging.getLogger("grpo_fast")


def run(trainer) -> list:
    """Runs ``trainer``'s remaining steps; returns the metrics of every step of the run. Rank 0
    writes the config, metrics, completions, progress bar and plot, and reports to the
    trackers; every eval_every steps the metrics line gains the eval metrics. The rollout
    source is closed on the way out, error or not. With push_to_hub, rank 0 uploads final/
    last (a failure is a ``hub.HubPushError``; the run's files are all written by then).

    A preemption signal ends the run with a checkpoint and :class:`faults.Preempted`;
    max_nonfinite_steps skipped steps in a row with :class:`faults.NonFiniteSteps`; a checkpoint
    that cannot be written with its :class:`checkpoint.CheckpointSaveError`, or, with
    on_save_failure='continue', a warning and a retry at the next save."""
    from tqdm.auto import tqdm

    config, main = trainer.config, trainer.runtime.ranks.is_main
    tracker = trackers.Tracker()
    if main:
        os.makedirs(trainer.output_dir, exist_ok=True)
        with open(os.path.join(trainer.output_dir, "config.yaml"), "w") as f:
            f.write(config.to_yaml())
        tracker = trackers.open_trackers(config.report_to, trainer.output_dir, config.to_dict())
    start = time.perf_counter()
    bar = tqdm(
        total=config.steps, initial=trainer.step, disable=not (config.progress and main), desc="grpo", unit="step"
    )
    preemption, nonfinite = faults.Preemption(trainer), faults.NonFiniteGuard(config.max_nonfinite_steps)
    saved = trainer.step if trainer.step else None  # a resumed run's checkpoint is its step's
    try:
        with preemption:
            while trainer.step < config.steps:
                result = preemption.run_step()
                if result is not None:
                    _record(trainer, result, tracker, bar)
                    step = trainer.step
                    if (config.save_every and step % config.save_every == 0) or step == config.steps:
                        saved = _save(trainer) or saved
                    nonfinite.check(result.metrics)
                if trainer.step < config.steps and preemption.requested():
                    raise preemption.stop(saved)
    finally:
        trainer.close()
        checkpoint.wait_for_manifests()
        bar.close()
        tracker.close()
    trainer.save_model()
    history = trainer.history
    trainer.plot_path = run_log.plot_rewards(history, os.path.join(trainer.output_dir, "reward.png")) if main else None
    trainer.summary = run_log.summary(history, trainer.output_dir, time.perf_counter() - start)
    if config.push_to_hub and main:
        url = hub.push(config, trainer.output_dir, os.path.join(trainer.output_dir, "final"))
        trainer.summary += f"\npushed final/ to {url}"
    return history


def _record(trainer, result, tracker, bar) -> None:
    """A finished step: its eval when due, its metrics line, completions and progress."""
    config, main = trainer.config, trainer.runtime.ranks.is_main
    metrics, batch = result
    step = trainer.step
    if trainer.evaluator is not None and (step == config.steps or run_log.due(step, config.eval_every, config.steps)):
        metrics.update(trainer.evaluate())
    trainer.history.append(metrics)
    if main:
        run_log.append_metrics(trainer.output_dir, metrics)
        tracker.log(metrics, step)
        if run_log.due(step, config.log_completions_every, config.steps) and batch.stats is not None:
            rows = run_log.completion_rows(batch, step, trainer.reward_names)
            run_log.append_completions(trainer.output_dir, rows)
            tracker.log_table("completions", rows, step)
    reward, kl = metrics["reward_mean"], metrics["kl"]
    bar.set_postfix(
        reward="-" if reward is None else f"{reward:.3f}",
        kl="-" if kl is None else f"{kl:.4f}",
        tok_s=f"{metrics['tokens_per_s']:.0f}",
        refresh=False,
    )
    bar.update(1)


def _save(trainer) -> int | None:
    """The step's checkpoint; its step, or None when it could not be written and the config
    says to go on (on_save_failure='continue': the error is logged, the next save retries)."""
    try:
        trainer.save_checkpoint()
    except checkpoint.CheckpointSaveError as exc:
        if trainer.config.on_save_failure != "continue":
            raise
        logger.warning("%s; training goes on (on_save_failure='continue')", exc)
        return None
    return trainer.step
