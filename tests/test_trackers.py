"""``--report-to``: each tracker's files read back with its own library, bad tracker names.

One short demo run reports to all four trackers (a ``grpo-fast train`` process, so that
trackio's store, fixed when trackio is imported, and wandb's service process stay out of the
test process); the tests then read what it wrote with TensorBoard's ``EventAccumulator``,
``MlflowClient``, wandb's record protocol on the offline run file and trackio's local store,
and compare with metrics.jsonl and completions.jsonl.
"""

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest

from grpo_fast.cli import main
from grpo_fast.trainer import GRPOConfig, GRPOTrainer, grpo
from grpo_fast.trainer.choices import TRACKERS, TrackerUnavailable
from grpo_fast.trainer.run.run_log import read_completions, read_metrics
from grpo_fast.trainer.run.trackers import parameters, scalars

RUN = ["--steps", "4", "--batch-size", "16", "-G", "4", "--max-new-tokens", "3", "--no-progress"]
RUN += ["--eval-every", "2", "--eval-samples", "4", "--log-completions-every", "2"]


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> dict:
    """A 4-step demo run with evaluation every 2 steps, reporting to every tracker offline."""
    root = tmp_path_factory.mktemp("trackers")
    run = root / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    env.update(TRACKIO_DIR=str(root / "trackio"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "grpo_fast", "train", "--output", str(run), *RUN, "--report-to", *TRACKERS]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    metrics = read_metrics(str(run))
    assert "eval/pass@1" in metrics[1] and "eval/pass@1" in metrics[3]
    return dict(
        run=run,
        env=env,
        metrics=metrics,
        completions=read_completions(str(run)),
        config=GRPOConfig.from_yaml(str(run / "config.yaml")).to_dict(),
    )


def logged(metrics: list) -> dict:
    """{key: {step: value}} of every number in the metrics lines."""
    out = {}
    for line in metrics:
        for key, value in scalars(line).items():
            out.setdefault(key, {})[line["step"]] = value
    return out


def assert_logged(got: dict, metrics: list, rel: float = 1e-12):
    """``got`` {key: {step: value}} holds every number of the metrics lines, to ``rel``."""
    want = logged(metrics)
    assert set(got) == set(want)
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=rel), key


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_metric_and_the_config(reported):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(reported["run"] / "tensorboard"))
    events.Reload()
    got = {key: {e.step: e.value for e in events.Scalars(key)} for key in events.Tags()["scalars"]}
    assert_logged(got, reported["metrics"], rel=1e-6)  # stored as float32
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["seed"].number_value == 0 and hparams["report_to"].string_value == json.dumps(list(TRACKERS))


@pytest.mark.slow
def test_mlflow_store_holds_every_metric_the_params_and_the_completions(reported):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{reported['run'] / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("grpo-fast")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params == {key: str(value) for key, value in parameters(reported["config"]).items()}
    got = {
        key: client.get_metric_history(run.info.run_id, key.replace("@", "_at_")) for key in logged(reported["metrics"])
    }
    assert_logged({key: {m.step: m.value for m in history} for key, history in got.items()}, reported["metrics"])
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    assert tables == ["completions/step_000002.json", "completions/step_000004.json"]
    with open(client.download_artifacts(run.info.run_id, tables[1])) as f:
        table = json.load(f)
    rows = [r for r in reported["completions"] if r["step"] == 4]
    assert table["columns"] == list(rows[0]) and len(table["data"]) == len(rows)
    for got, want in zip(table["data"], rows):  # MLflow's JSON keeps 10 digits
        for a, b in zip(got, want.values()):
            assert a == (pytest.approx(b, rel=1e-9) if isinstance(b, float) else b)


def wandb_records(path: str) -> list:
    """The records of a wandb run file: a 7-byte header, then LevelDB-log chunks (32 KiB blocks,
    each chunk a 7-byte header: crc32c, length, type 1 = whole, 2..4 = first, middle, last)
    whose payloads are wandb's ``Record`` protocol buffers."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, records = open(path, "rb").read(), 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or kind == 0:  # a block's zero-filled tail
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_every_metric_the_config_and_the_completions(reported):
    (path,) = glob.glob(str(reported["run"] / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert config == reported["config"]
    got = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = "/".join(item.nested_key) or item.key
                if not key.startswith(("_", "completions")):
                    got.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    assert_logged(got, reported["metrics"])
    (table,) = glob.glob(str(reported["run"] / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*_4_*"))
    rows = [r for r in reported["completions"] if r["step"] == 4]
    with open(table) as f:
        assert json.load(f) == {"columns": list(rows[0]), "data": [list(r.values()) for r in rows]}


@pytest.mark.slow
def test_trackio_local_store_holds_every_metric_the_config_and_the_completions(reported):
    read = (
        "import json; from trackio.sqlite_storage import SQLiteStorage as S; "
        "print(json.dumps([S.get_logs('grpo-fast', 'run'), S.get_run_config('grpo-fast', 'run')]))"
    )
    proc = subprocess.run([sys.executable, "-c", read], env=reported["env"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs, config = json.loads(proc.stdout.splitlines()[-1])
    assert {k: v for k, v in config.items() if not k.startswith("_")} == reported["config"]
    got = {}
    for line in logs:
        for key, value in line.items():
            if key not in ("step", "timestamp", "completions"):
                got.setdefault(key, {})[line["step"]] = value
    assert_logged(got, reported["metrics"])
    tables = {line["step"]: line["completions"]["_value"] for line in logs if "completions" in line}
    assert tables == {s: [r for r in reported["completions"] if r["step"] == s] for s in (2, 4)}


# ---------------------------------------------------------------- bad names, missing libraries
def test_an_unknown_tracker_lists_the_valid_ones(capsys):
    with pytest.raises(ValueError, match=r"unknown tracker 'tensorbord'; valid trackers are \['tensorboard', 'wandb'"):
        GRPOConfig(report_to=["tensorbord"]).validate()
    with pytest.raises(ValueError, match=r"report_to must be a list of tracker names, got 'wandb'"):
        GRPOConfig(report_to="wandb").validate()
    assert main(["train", "--report-to", "mlflow", "comet", "--steps", "1"]) == 2
    assert "unknown tracker 'comet'" in capsys.readouterr().err


def test_a_missing_tracker_library_names_its_extra_before_the_model_loads(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the tracker check")

    monkeypatch.setattr(grpo, "load_model_and_tokenizer", no_model)
    config = GRPOConfig(model=str(tmp_path), report_to=["tensorboard", "wandb"], output_dir=str(tmp_path))
    with pytest.raises(
        TrackerUnavailable, match=r'report_to=\'wandb\' needs the \'wandb\' package: pip install "grpo-fast\[wandb\]"'
    ):
        GRPOTrainer(config)
    assert main(["train", "--report-to", "wandb", "--output", str(tmp_path)]) == 2
    assert 'pip install "grpo-fast[wandb]"' in capsys.readouterr().err
