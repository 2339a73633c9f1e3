"""`relayrl sweep` of the quickstart (marker extended: make test-extended): four trials at 30 s of RL each from one shared SFT warm-up finish and
name the best trial; the same sweep killed (SIGKILL) while its third trial trains leaves no process running, and
resumes (`--resume`) to four finished trials, the interrupted one run again."""

import csv
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from deploy.experiment.quickstart import write_project
from deploy.sweep.config import load_sweep
from tests.test_quickstart_experiment import _alive, _descendants

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> pathlib.Path:
    """The quickstart's project (its experiment file), written once for the module."""
    return write_project(tmp_path_factory.mktemp("quickstart") / "project")


QUICK = {"training.time_budget_s": 30, "evaluation.every_s": 10, "sft.steps": 300}
QUICK_SPACE = {"training.lr": {"type": "float", "low": 3.0e-5, "high": 1.0e-3, "log": True},
               "training.temperature": {"type": "categorical", "choices": [0.7, 1.0]}}


@pytest.fixture(scope="module")
def warmed(project, tmp_path_factory) -> pathlib.Path:
    """The quickstart's SFT warm-up for these sweeps, made once by the sweep's own shared warm-up (a folder holding
    model-sft/ and warmup.json): each sweep below starts from a copy, as a sweep resumed in its folder does."""
    from rich.console import Console

    from deploy.sweep.study import shared_warmup

    folder = tmp_path_factory.mktemp("warmup")
    sweep = load_sweep(_quick_sweep(folder, project))
    started = time.monotonic()
    assert shared_warmup(sweep, Console()) == sweep.dir / "model-sft"
    print(f"shared SFT warm-up ({QUICK['sft.steps']} steps): {time.monotonic() - started:.0f}s")
    return sweep.dir


def _quick_sweep(folder: pathlib.Path, project: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "experiment": str(project), "sweep_dir": "sweep", "set": QUICK, "params": QUICK_SPACE, "trials": 4,
        "objective": "final", "sampler": {"seed": 0, "n_startup_trials": 2},
        "pruner": {"n_startup_trials": 2, "n_warmup_steps": 1}}, sort_keys=False))
    return path


def _start_sweep(folder: pathlib.Path, *flags: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "deploy", "sweep", str(folder / "sweep.yaml"), *flags], env=env,
                            cwd=folder, text=True, **popen)


def _prepared(folder: pathlib.Path, project: pathlib.Path, warmed: pathlib.Path) -> pathlib.Path:
    """A sweep folder holding the shared warm-up already (copied): the sweep keeps it, as a resumed one does."""
    _quick_sweep(folder, project)
    shutil.copytree(warmed / "model-sft", folder / "sweep" / "model-sft")
    shutil.copyfile(warmed / "warmup.json", folder / "sweep" / "warmup.json")
    return folder / "sweep"


def _rows(sweep_dir: pathlib.Path) -> list[dict]:
    return list(csv.DictReader((sweep_dir / "results.csv").read_text().splitlines()))


def _left_running(sweep_dir: pathlib.Path, within_s: float = 15.0) -> list[str]:
    """Command lines of processes still naming `sweep_dir` (a trial's services, trainer, driver) after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended meanwhile
                continue
            if str(sweep_dir) in args:
                left.append(args)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _assert_named_best(stdout: str, sweep_dir: pathlib.Path) -> dict:
    rows = _rows(sweep_dir)
    completed = [r for r in rows if r["state"] == "complete"]
    best = max(completed, key=lambda r: float(r["value"]))
    assert f"best trial: trial-{best['trial']}" in stdout, stdout[-3000:]
    run = pathlib.Path(best["run_dir"])
    summary = json.loads((run / "summary.json").read_text())
    assert float(best["value"]) == summary["final_accuracy"] and (run / "config.yaml").is_file()
    assert (run / "tensorboard").is_dir() and (run / "services.json").is_file()  # an ordinary run folder
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["path"] == str(sweep_dir / "model-sft")
    for name in ("optimization_history", "intermediate_values"):
        assert (sweep_dir / "plots" / f"{name}.png").is_file() and (sweep_dir / "plots" / f"{name}.html").is_file()
    assert (sweep_dir / "plots" / "param_importances.png").is_file() == (len(completed) >= 3)
    print(f"best: trial-{best['trial']} value {best['value']} start {best['start']} "
          f"training.lr={best['training.lr']} training.temperature={best['training.temperature']}")
    return best


@pytest.mark.extended
@pytest.mark.timeout(900)
def test_a_sweep_of_four_quickstart_trials_finishes_and_names_the_best(project, warmed, tmp_path):
    sweep_dir = _prepared(tmp_path, project, warmed)
    started = time.monotonic()
    sweep = _start_sweep(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stdout, _ = sweep.communicate(timeout=840)
    assert sweep.returncode == 0, stdout[-4000:]
    print(f"4 trials: {time.monotonic() - started:.0f}s")
    rows = _rows(sweep_dir)
    assert [r["trial"] for r in rows] == ["0", "1", "2", "3"]
    assert all(r["state"] in ("complete", "pruned") for r in rows), rows
    assert "is whole: every trial starts RL from it" in stdout  # the warm-up is not run again
    assert not _left_running(sweep_dir)  # a pruned trial's run stopped every process it started
    for row in rows:
        print(f"trial-{row['trial']} {row['state']} value {row['value']} evaluations {row['evaluations']} "
              f"lr {row['training.lr']} temperature {row['training.temperature']}")
    _assert_named_best(stdout, sweep_dir)


@pytest.mark.extended
@pytest.mark.timeout(1200)
def test_a_sweep_killed_after_two_trials_resumes_and_finishes_four(project, warmed, tmp_path):
    """SIGKILL of the sweep while its third trial trains: the trial's run stops every process it started (the
    parent-death signal), and `relayrl sweep --resume` keeps the two finished trials, marks the third failed, runs
    its parameters again and finishes four."""
    sweep_dir = _prepared(tmp_path, project, warmed)
    started = time.monotonic()
    with open(tmp_path / "first.log", "w") as log:
        sweep = _start_sweep(tmp_path, stdout=log, stderr=subprocess.STDOUT)
    curve = sweep_dir / "trial-2" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (curve.is_file() and curve.read_text().strip()):  # trial-2 measured its start of RL
        assert sweep.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the third trial never started RL"
        time.sleep(0.5)
    interrupted_at = time.monotonic() - started
    processes = _descendants(sweep.pid)
    assert len(processes) >= 6  # the trial's run, its buffer, reward, rollout, driver, trainer
    sweep.send_signal(signal.SIGKILL)
    sweep.wait(10)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in processes if _alive(pid)], "the killed sweep's trial left processes running"

    resumed = _start_sweep(tmp_path, "--resume", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stdout, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stdout[-4000:]
    print(f"killed at {interrupted_at:.0f}s (trial-2 training), resumed and finished: "
          f"{time.monotonic() - started:.0f}s in all")
    assert "resuming the sweep" in stdout and "trial-2: interrupted" in stdout
    rows = {r["trial"]: r for r in _rows(sweep_dir)}
    assert set(rows) == {"0", "1", "2", "3", "4"}
    assert rows["2"]["state"] == "fail" and rows["2"]["note"].startswith("interrupted")
    assert rows["3"]["note"] == "re-run of trial-2"
    assert (rows["3"]["training.lr"], rows["3"]["training.temperature"]) == (
        rows["2"]["training.lr"], rows["2"]["training.temperature"])
    assert sum(r["state"] in ("complete", "pruned") for r in rows.values()) == 4
    assert not _left_running(sweep_dir)
    _assert_named_best(stdout, sweep_dir)
