"""Acceptance: `relayrl status RUN_DIR` on a live run lists every service with its fields; the run leaves
TensorBoard event files of every namespace and, without a terminal, plain progress lines."""

import io
import json
import os
import subprocess
import sys
import threading

import pytest
from live_run_kit import wait_for
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import load_experiment
from deploy.runs.experiment_run import run_experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_status_of_a_live_quickstart_run(tmp_path):
    run_dir = tmp_path / "run"
    config = load_experiment(write_project(tmp_path / "project"), [
        f"run_dir={run_dir}", "sft.steps=0", "data.num_eval=16", "training.time_budget_s=45", "evaluation.every_s=10"])
    out, ended = io.StringIO(), {}
    thread = threading.Thread(target=lambda: ended.update(summary=run_experiment(config, Console(file=out, width=200))))
    thread.start()
    try:
        trainer_metrics = run_dir / "trainer_metrics.jsonl"
        wait_for(lambda: trainer_metrics.exists() and len(trainer_metrics.read_text().splitlines()) >= 2, thread,
                 300, "two trainer steps")
        status = subprocess.run([sys.executable, "-m", "deploy.cli", "status", str(run_dir), "--json",
                                 "--interval", "3"], check=False, capture_output=True, text=True, timeout=120,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    finally:
        thread.join(400)
    assert "summary" in ended, out.getvalue()[-3000:]

    assert status.returncode == 0, status.stderr
    rows = {row["name"]: row for row in json.loads(status.stdout)["services"]}
    assert set(rows) == {"buffer", "reward", "rollout"}
    for row in rows.values():
        assert row["up"] and row["health"] == "SERVING" and row["metrics"] == "on"
        assert row["errors"]["total"] >= 0 and row["throughput"]["rpcs"] >= 0
    assert rows["rollout"]["weight_version"] >= 1 and rows["buffer"]["weight_version"] >= 1  # the trainer published
    assert set(rows["rollout"]["queue"]) == {"running", "waiting"}
    assert set(rows["buffer"]["queue"]) == {"ready", "leased"}
    assert rows["buffer"]["staleness"]["max_staleness"] == 1
    assert rows["rollout"]["throughput"]["tokens"] > 0 and rows["buffer"]["throughput"]["put"] > 0
    assert rows["reward"]["throughput"]["scored"] > 0

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    namespaces = {tag.split("/")[0] for tag in events.Tags()["scalars"]}
    assert namespaces == {"trainer", "driver", "eval", "buffer", "reward", "rollout"}
    steps = [json.loads(line)["step"] for line in trainer_metrics.read_text().splitlines()]
    assert [e.step for e in events.Scalars("trainer/loss")] == steps

    lines = [line for line in out.getvalue().splitlines() if line.startswith("time ")]
    assert len(lines) >= 4, out.getvalue()  # ~45 s of RL: a line at 0, 10, 20, 30, 40 s
    assert all(" step " in line and " tokens/s " in line and " held-out acc " in line for line in lines)
