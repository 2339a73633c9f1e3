"""The quickstart as a shipped experiment file (deploy/experiment/quickstart_experiment.yaml, deploy/experiment/quickstart.py):
`relayrl run` with no argument writes the project the way a user lays one out and runs that file: every 2-digit
addition, 200 held out by a seeded shuffle, warmed up on `prompt -> answer` and measured on the held-out ones."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import main as doctor

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_project_holds_every_addition_with_200_held_out(tmp_path):
    from deploy.experiment import data as experiment_data
    from deploy.experiment.tasks import arithmetic_tasks, split_tasks
    from deploy.runs.experiment_run import _sft_samples

    experiment = write_project(tmp_path / "project")
    config = load_experiment(experiment)
    assert config.run_dir == str((tmp_path / "quickstart").resolve())
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    train_rows, eval_rows = experiment_data.split(config.data, tokenizer, config.seed)
    train_tasks, eval_tasks = split_tasks(arithmetic_tasks(2, "+"), 200, 0)
    assert [(row.prompt_id, row.prompt, row.metadata["answer"]) for row in train_rows] == [
        (t.prompt_id, t.prompt, t.answer) for t in train_tasks]
    # Held out: never trained on, measured as the driver tokenizes a prompt (bos first).
    assert [(experiment_data.prompt_ids(row, tokenizer, True), row.metadata["answer"]) for row in eval_rows] == [
        ([tokenizer.bos_token_id, *tokenizer.encode(t.prompt, add_special_tokens=False)], t.answer) for t in eval_tasks]
    assert not {row.prompt for row in train_rows} & {row.prompt for row in eval_rows}
    # The SFT warm-up's samples: bos + prompt -> answer + eos.
    samples = _sft_samples(train_rows, tokenizer, add_bos=True)
    assert [s.prompt_id for s in samples] == [t.prompt_id for t in train_tasks]
    assert all(s.prompt_ids.tolist() == [tokenizer.bos_token_id, *tokenizer.encode(t.prompt, add_special_tokens=False)]
               and s.response_ids.tolist() == [*tokenizer.encode(t.answer, add_special_tokens=False),
                                               tokenizer.eos_token_id]
               for s, t in zip(samples, train_tasks, strict=True))
    assert write_project(tmp_path / "project") == experiment  # written once, kept


def test_doctor_passes_the_quickstart_project(tmp_path):
    assert doctor(str(write_project(tmp_path / "project"))) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_relayrl_run_without_an_argument_runs_the_quickstart_experiment(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "run", "--set", "sft.steps=60", "--set", "training.time_budget_s=20",
         "--set", "evaluation.every_s=8"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=500,
        check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "runs/quickstart-project" in done.stdout
    run = tmp_path / "runs" / "quickstart"
    curve = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(curve) >= 2 and all(0 <= point["accuracy"] <= 1 for point in curve)
    assert (run / "summary.json").is_file() and (run / "export" / "config.json").is_file()
    assert (tmp_path / "runs" / "quickstart-project" / "experiment.yaml").read_text() == (
        ROOT / "deploy" / "experiment" / "quickstart_experiment.yaml").read_text()


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in pathlib.Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except FileNotFoundError:  # the thread (or process) ended meanwhile
                continue
            todo.extend(children - found)
            found |= children
    return found


def _alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _training_job(tmp_path) -> tuple[subprocess.Popen, set[int]]:
    """`relayrl run` (in its own process group, as a terminal starts it) once its trainer has taken a step, and
    every process it started by then."""
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    job = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", "--set", "sft.steps=5", "--set",
                            "training.time_budget_s=200"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = tmp_path / "runs" / "quickstart" / "trainer_metrics.jsonl"
    deadline = time.monotonic() + 200
    while not (metrics.exists() and metrics.read_text().strip()):
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            raise AssertionError("the run never reached a training step")
        time.sleep(0.5)
    started = _descendants(job.pid)
    assert len(started) >= 5  # buffer, reward, rollout, driver, trainer (and the reward's workers)
    return job, started


def _left_alive(started: set[int], within_s: float) -> list[int]:
    import time

    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in started if _alive(pid)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_stops_the_run_and_every_process_it_started(tmp_path):
    """Python's default SIGTERM ended `relayrl run` at once and left its services, trainer and driver running."""
    import signal

    job, started = _training_job(tmp_path)
    try:
        job.send_signal(signal.SIGTERM)
        assert job.wait(120) == 128 + signal.SIGTERM
        assert not _left_alive(started, 30)
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_run_and_every_process_it_started_within_seconds(tmp_path):
    """Ctrl-C reaches every process of the job at once. The driver's groups then waited on calls to services
    already gone, retried, until the job killed it 20 s later, and each process's exit spent seconds in the
    interpreter's last garbage collection: 24 s in all. Now the driver abandons them after 3 s."""
    import signal
    import time

    job, started = _training_job(tmp_path)
    try:
        pressed = time.monotonic()
        os.killpg(job.pid, signal.SIGINT)
        code = job.wait(60)
        left = _left_alive(started, max(0.0, 15 - (time.monotonic() - pressed)))
        stopped_in = time.monotonic() - pressed
        assert stopped_in < 15 and not left, f"{stopped_in:.1f}s after Ctrl-C, still running: {left}"
        assert code == 128 + signal.SIGINT  # and a line, not a traceback
    finally:
        job.kill()
