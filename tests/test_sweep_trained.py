"""A sweep counts only trials that trained (issue 41, item 4), with real runs: a trial whose run could not train is
Optuna's FAIL with the reason in results.csv and the table, never the best, and a sweep of such trials only exits
non-zero; the shipped sweep file (examples/sweep/quickstart_sweep.yaml, which searches algorithm.kl_coef in [0, 0.1])
runs with tiny budgets and every trial takes optimizer steps."""

import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from deploy.experiment.quickstart import write_project

ROOT = pathlib.Path(__file__).resolve().parent.parent


def sweep(path: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "deploy", "sweep", str(path)], capture_output=True, text=True,
                          env=env, cwd=path.parent, timeout=840, check=False)


def rows(sweep_dir: pathlib.Path) -> list[dict]:
    return list(csv.DictReader((sweep_dir / "results.csv").read_text().splitlines()))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trial_whose_run_could_not_train_fails_and_a_sweep_of_them_exits_non_zero(tmp_path):
    """The trial's trainer raises on its first batch and restarts until the budget runs out: no optimizer step. Before,
    its run exited 0, the trial completed with the held-out value it started from and was named the best trial."""
    project = write_project(tmp_path / "project")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "experiment": str(project), "sweep_dir": "sweep", "trials": 1, "warmup": "per_trial",
        "set": {"sft.steps": 20, "data.num_eval": 20, "training.time_budget_s": 20, "evaluation.every_s": 100,
                "supervise.max_restarts": 8, "services.trainer.settings.mismatch.metric": "abs_max",
                "services.trainer.settings.mismatch.stop_above": 1.0e-12},
        "params": {"training.lr": {"type": "float", "low": 1.0e-4, "high": 2.0e-4}}}, sort_keys=False))
    done = sweep(path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = rows(tmp_path / "sweep")
    assert row["state"] == "fail" and row["value"] == "", row
    assert "could not train: the trainer took no optimizer step" in row["note"], row
    assert "MismatchTooLarge" in row["note"], row
    assert "best trial" not in done.stdout and "no trial completed" in done.stdout, done.stdout[-3000:]
    assert "trial-0 failed" in done.stdout and "MismatchTooLarge" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_shipped_sweep_file_runs_and_every_trial_trains(tmp_path):
    """examples/sweep/quickstart_sweep.yaml as shipped, its budgets cut (2 trials of 20 s of RL after a short shared
    SFT): each trial samples algorithm.kl_coef from [0, 0.1], which took 0 optimizer steps in every trial before."""
    example = tmp_path / "examples" / "sweep" / "quickstart_sweep.yaml"
    example.parent.mkdir(parents=True)
    shipped = yaml.safe_load((ROOT / "examples" / "sweep" / "quickstart_sweep.yaml").read_text())
    assert shipped["params"]["algorithm.kl_coef"] == {"type": "float", "low": 0.0, "high": 0.1}
    shipped["trials"] = 2
    shipped["set"].update({"training.time_budget_s": 20, "evaluation.every_s": 10, "sft.steps": 60,
                           "data.num_eval": 40})
    example.write_text(yaml.safe_dump(shipped, sort_keys=False))
    done = sweep(example)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    sweep_dir = tmp_path / "runs" / "quickstart-sweep"
    results = rows(sweep_dir)
    assert len(results) == 2 and all(row["state"] in ("complete", "pruned") for row in results), results
    for row in results:
        trainer = [json.loads(line) for line in
                   (pathlib.Path(row["run_dir"]) / "trainer_metrics.jsonl").read_text().splitlines()]
        print(f"trial-{row['trial']}: kl_coef {float(row['algorithm.kl_coef']):.4f}, {len(trainer)} steps, "
              f"kl {trainer[-1].get('kl', 0):.4g}, held-out {row['start']} -> {row['final']}")
        assert trainer and int(row["steps"]) > 0, row
        assert float(row["algorithm.kl_coef"]) == 0 or "kl" in trainer[-1], trainer[-1]
    assert any(float(row["algorithm.kl_coef"]) > 0 for row in results), results  # the case that took 0 steps before
    assert "best trial: trial-" in done.stdout
