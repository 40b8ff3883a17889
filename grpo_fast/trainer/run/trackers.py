"""Experiment trackers (``--report-to``): TensorBoard, Weights & Biases, MLflow, trackio.

A tracker gets the run's config once as its parameters, then every metrics line as
``metrics.jsonl`` holds it (the same keys: numbers only, ``step`` as the step axis), and the
completions samples as tables where the library has tables. :class:`Tracker` is the
do-nothing default; each library has one thin adapter that calls it directly, offline and
local first:

    tensorboard   event files in <run>/tensorboard (torch.utils.tensorboard)
    wandb         an offline run in <run>/wandb (WANDB_MODE, e.g. online, overrides it)
    mlflow        a SQLite store <run>/mlflow.db (MLFLOW_TRACKING_URI overrides it)
    trackio       trackio's local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio)

transformers' ``report_to`` callbacks rename keys (``train/...``) and read a Trainer's state,
so they are not used here. Only rank 0 opens trackers (``GRPOTrainer.train``).
"""

import json
import math
import os
import time
from pathlib import Path

from grpo_fast.trainer.choices import check_trackers

PROJECT = "grpo-fast"  # the wandb / MLflow experiment / trackio project a run goes to


def scalars(metrics: dict) -> dict:
    """The numbers of a metrics line, ``step`` and unlogged (None) values left out."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def parameters(config: dict) -> dict:
    """The run's config as flat parameters: numbers, strings and bools as they are, the rest
    (None, lists) as their JSON text."""
    return {
        key: value if isinstance(value, (int, float, str, bool)) else json.dumps(value) for key, value in config.items()
    }


def columns_and_data(rows: list) -> tuple:
    """``(column names, [one list of values per row])`` of rows (dicts with the same keys)."""
    columns = list(rows[0])
    return columns, [[_cell(row[column]) for column in columns] for row in rows]


def _cell(value):
    """A table cell: a trajectory's messages (a multi-turn rollout) as JSON text, which every
    library's tables hold."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (list, dict)) else value


class Tracker:
    """The do-nothing tracker, and the interface every adapter fills in."""

    def log(self, metrics: dict, step: int) -> None:
        """One metrics line (as in metrics.jsonl) at ``step``."""

    def log_table(self, name: str, rows: list, step: int) -> None:
        """Rows (dicts with the same keys) as a table ``name`` at ``step``, where the library has tables."""

    def close(self) -> None:
        """Flushes and ends the run."""


class Trackers(Tracker):
    """Several trackers as one."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, metrics: dict, step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_table(self, name: str, rows: list, step: int) -> None:
        for tracker in self.trackers:
            tracker.log_table(name, rows, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


class TensorBoardTracker(Tracker):
    """Scalars in ``<run>/tensorboard``; the config as the run's hparams (no tables)."""

    def __init__(self, output_dir: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        for summary in hparams(parameters(config), {}):
            self.writer.file_writer.add_summary(summary)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A wandb run in ``<run>/wandb``, offline unless WANDB_MODE says otherwise."""

    def __init__(self, output_dir: str, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=os.path.basename(os.path.abspath(output_dir)),
            dir=output_dir,
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=config,
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def log_table(self, name: str, rows: list, step: int) -> None:
        columns, data = columns_and_data(rows)
        self.run.log({name: self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker(Tracker):
    """An MLflow run in experiment ``grpo-fast`` of a SQLite store ``<run>/mlflow.db``
    (artifacts in ``<run>/mlartifacts``), or of MLFLOW_TRACKING_URI; the config as its params,
    tables as JSON artifacts. MLflow allows no ``@`` in a metric name: ``eval/pass@1`` is
    logged as ``eval/pass_at_1``, the one key a tracker renames."""

    def __init__(self, output_dir: str, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        run_dir = os.path.abspath(output_dir)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.join(run_dir, "mlflow.db")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(PROJECT, artifact_location=Path(run_dir, "mlartifacts").as_uri())
        )
        run = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(output_dir)))
        self.run_id = run.info.run_id
        params = [Param(key, str(value)) for key, value in parameters(config).items()]
        self.client.log_batch(self.run_id, params=params)

    def log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [
            Metric(key.replace("@", "_at_"), value, now, step)
            for key, value in scalars(metrics).items()
            if math.isfinite(value)
        ]
        self.client.log_batch(self.run_id, metrics=values)

    def log_table(self, name: str, rows: list, step: int) -> None:
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        self.client.log_table(self.run_id, columns, artifact_file=f"{name}/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker(Tracker):
    """A trackio run in project ``grpo-fast`` of trackio's local store."""

    def __init__(self, output_dir: str, config: dict):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", PROJECT),
            name=os.path.basename(os.path.abspath(output_dir)),
            config=config,
        )

    def log(self, metrics: dict, step: int) -> None:
        self.trackio.log(scalars(metrics), step=step)

    def log_table(self, name: str, rows: list, step: int) -> None:
        columns, data = columns_and_data(rows)
        self.trackio.log({name: self.trackio.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


# one adapter per name of choices.TRACKERS
ADAPTERS = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MLflowTracker,
    "trackio": TrackioTracker,
}


def open_trackers(names, output_dir: str, config: dict) -> Tracker:
    """The trackers ``names`` (None or [] = the do-nothing one) for the run in ``output_dir``."""
    check_trackers(names)
    if not names:
        return Tracker()
    return Trackers([ADAPTERS[name](output_dir, config) for name in dict.fromkeys(names)])
