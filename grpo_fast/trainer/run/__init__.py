"""The run around the steps: the loop, checkpoints, evaluation, logs, trackers, the Hub.

    loop.py           the run: the steps with their cadences (eval, completions, checkpoints)
    checkpoint.py     one folder per step, written by every rank, complete or invisible
    evaluation.py     held-out pass@k with its own engine (also ``grpo-fast eval``)
    run_log.py        metrics.jsonl, completions.jsonl, the reward plot, the summary
    trackers.py       ``--report-to``: TensorBoard, W&B, MLflow, trackio
    hub.py            the model card and ``--push-to-hub``

May import: the trainer's core, the model, rollout and update sides (evaluation samples with
an engine; the logs read a step's batch), ``grpo_fast`` below the trainer. Never ``grpo.py``
(the loop is handed the trainer it runs).
"""
