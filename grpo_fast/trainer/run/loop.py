"""The run around the steps: the config and metrics files, trackers, the progress bar, the
evaluation and completion cadence, checkpoints, the final model and its card, the reward plot
and the push to the Hub."""

import os
import time

from grpo_fast.trainer.run import hub, run_log, trackers


def run(trainer) -> list:
    """Runs ``trainer``'s remaining steps; returns the metrics of every step of the run. Rank 0
    writes the config, metrics, completions, progress bar and plot, and reports to the
    trackers; every eval_every steps the metrics line gains the eval metrics. The rollout
    source is closed on the way out, error or not. With push_to_hub, rank 0 uploads final/
    last (a failure is a ``hub.HubPushError``; the run's files are all written by then)."""
    from tqdm.auto import tqdm

    config, main = trainer.config, trainer.runtime.ranks.is_main
    tracker = trackers.Tracker()
    if main:
        import yaml

        os.makedirs(trainer.output_dir, exist_ok=True)
        with open(os.path.join(trainer.output_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(config.to_dict(), f, sort_keys=False)
        tracker = trackers.open_trackers(config.report_to, trainer.output_dir, config.to_dict())
    start = time.perf_counter()
    bar = tqdm(
        total=config.steps, initial=trainer.step, disable=not (config.progress and main), desc="grpo", unit="step"
    )
    try:
        while trainer.step < config.steps:
            metrics, batch = trainer.run_step()
            step = trainer.step
            if trainer.evaluator is not None and (
                step == config.steps or run_log.due(step, config.eval_every, config.steps)
            ):
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
            if (config.save_every and step % config.save_every == 0) or step == config.steps:
                trainer.save_checkpoint()
    finally:
        trainer.close()
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
