"""Weights & Biases and MLflow beside TensorBoard (deploy/record/loggers.py): off by default, their libraries imported only
when on, and each one, offline, holding the run's curves where its own tools read them: W&B's offline run folder
(the records of its .wandb file), MLflow's file store (MlflowClient)."""

import json
import pathlib
import struct
import subprocess
import sys

import pytest
import yaml
from test_tensorboard import DRIVER_LINE, TRAINER_LINES, append

from deploy.experiment.schema import ExperimentConfig
from deploy.experiment.sections import LoggingSection, MlflowSection, WandbSection
from deploy.record.loggers import writers
from deploy.record.tensorboard import RunBoard

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTINGS = {"model": {"path": "model"}, "data": {"train": {"path": "train.jsonl"}}, "training": {"lr": 3e-6},
            "services": {"buffer": {"client": {"token": "secret"}}}}


def wandb_history(folder: pathlib.Path) -> tuple[list[dict], dict]:
    """(The history rows, the config) of the offline W&B run under `folder`, read from its .wandb file: a LevelDB
    log (32 KiB blocks of records with 7-byte headers) of wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data, position, pieces, history, config = path.read_bytes(), 7, b"", [], {}
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's trailer or padding: on to the next block
            position += left
            continue
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.HasField("history"):
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
            elif record.HasField("run"):
                config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.run.config.update}
    return history, config


def test_loggers_are_off_by_default_and_their_libraries_not_imported():
    config = ExperimentConfig.model_validate(SETTINGS)
    assert config.logging == LoggingSection() and config.logging.wandb is None and config.logging.mlflow is None
    code = ("import sys; from deploy.experiment.schema import ExperimentConfig; import deploy.rl.pipeline, deploy.record.loggers; "
            "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert done.stdout.strip() == "[]"


def test_the_experiment_file_turns_them_on(tmp_path):
    from deploy.experiment.schema import load_experiment

    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({**SETTINGS, "logging": {"tensorboard": True, "wandb": {"project": "p",
                                                                                             "mode": "offline"},
                                                            "mlflow": {"experiment": "e"}}}))
    config = load_experiment(path, ["logging.wandb.tags=[a, b]"])
    assert config.logging.wandb == WandbSection(project="p", mode="offline", tags=["a", "b"])
    assert config.logging.mlflow == MlflowSection(experiment="e")


@pytest.mark.timeout(300)
def test_wandb_offline_and_an_mlflow_file_store_hold_the_runs_curves(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    section = LoggingSection(wandb=WandbSection(project="relayrl-test", mode="offline"), mlflow=MlflowSection())
    settings = ExperimentConfig.model_validate(SETTINGS).model_dump(mode="json")
    board = RunBoard(tmp_path, "driver", list, writers=writers(section, tmp_path, settings))
    board.eval({"elapsed_s": 0.0, "accuracy": 0.25, "step": 0, "reward_mean": None})
    append(tmp_path / "trainer_metrics.jsonl", TRAINER_LINES)
    append(tmp_path / "driver_stats.jsonl", [DRIVER_LINE])
    board.tick(3.0)
    board.eval({"elapsed_s": 15.2, "accuracy": 0.5, "step": 2, "reward_mean": 0.31})
    board.close()

    history, config = wandb_history(tmp_path)
    trainer = [(row["trainer/step"], row["trainer/loss"]) for row in history if "trainer/loss" in row]
    assert trainer == [(1, 0.5), (2, 0.4)]
    assert [(row["rl_seconds"], row["eval/accuracy"]) for row in history if "eval/accuracy" in row] == [(0, 0.25),
                                                                                                     (15, 0.5)]
    assert any(row.get("driver/tokens_per_s") == 128.0 for row in history)
    assert config["training"]["lr"] == 3e-6 and "services" not in config  # no tokens in the record

    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("relayrl").experiment_id])
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "trainer/loss")] == [(1, 0.5),
                                                                                                      (2, 0.4)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [(0, 0.25),
                                                                                                       (15, 0.5)]
    assert run.data.params["training.lr"] == "3e-06" and not any(k.startswith("services") for k in run.data.params)

    events = EventAccumulator(str(tmp_path / "tensorboard"))  # TensorBoard as before, beside them
    events.Reload()
    assert [e.value for e in events.Scalars("trainer/loss")] == pytest.approx([0.5, 0.4])


def test_doctor_checks_each_logger_that_is_on(tmp_path, monkeypatch, capsys):
    from user_project import write_project

    from deploy.inspect.doctor import main as doctor

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: never logged in
    project = write_project(tmp_path / "project", tmp_path / "run")
    assert doctor(str(project), ["logging.wandb={mode: online}", "logging.mlflow={}"]) == 0
    out = capsys.readouterr().out
    assert "WARN  logging (wandb): mode online, but no WANDB_API_KEY nor a `wandb login`" in out, out
    assert "OK    logging (mlflow): mlflow-skinny " in out
    assert doctor(str(project), ["logging.wandb={mode: offline}"]) == 0
    assert "OK    logging (wandb): wandb " in capsys.readouterr().out
