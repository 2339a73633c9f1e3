"""`relayrl run --resume RUN_DIR`: a whole job SIGKILLed (every process of it at once) goes on from its folder.

The slow test starts `relayrl run EXPERIMENT.yaml` in its own process group, kills the group (and every service
services.json names) once the trainer has checkpointed and trained past the checkpoint, then resumes the run to
its end. The resumed trainer goes on after its checkpoint's step (the steps after it were lost with the trainer
and are trained again), weight versions keep growing, the RL clock counts the time spent before the kill, the
curve goes on, and in the final model's history no sample is trained twice while the buffer acked each once.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import yaml
from test_chaos import final_history, read_buffer_log
from user_project import write_project

from deploy.cli import main as cli
from trainer.checkpoint import STATE_FILE, latest_checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUDGET_S = 40.0  # seconds of RL in all, before and after the kill
KILL_AFTER_S = 12.0  # seconds of RL before it (the tiny model trains several steps a second)
CHECKPOINT_INTERVAL = 5


def relayrl(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def experiment_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = write_project(tmp_path / "project", tmp_path / "run", time_budget_s=BUDGET_S, max_steps=None,
                         metrics_sample_ids=True)
    config = yaml.safe_load(path.read_text())
    config["checkpoint"]["interval"] = CHECKPOINT_INTERVAL
    config["evaluation"]["every_s"] = 15
    # One log segment: every put and ack record stays readable for the audit.
    config["services"] = {"buffer": {"settings": {"segment_bytes": 1 << 30}}}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def rl_seconds(run_dir: pathlib.Path) -> float:
    clock = run_dir / "rl_clock.json"
    return json.loads(clock.read_text())["rl_seconds"] if clock.exists() else 0.0


def steps_so_far(run_dir: pathlib.Path) -> tuple[int, int]:
    """(the latest checkpoint's step, the last step in trainer_metrics.jsonl); 0 for none."""
    checkpoint = latest_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").exists() else None
    saved = json.loads((checkpoint / STATE_FILE).read_text())["step"] if checkpoint else 0
    metrics = run_dir / "trainer_metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return saved, json.loads(lines[-1])["step"] if lines else 0


def kill_the_job(job: subprocess.Popen, run_dir: pathlib.Path) -> None:
    """SIGKILL the job's process group, and by pid every service the run recorded (were it in another group)."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:  # the job ended on its own (the test fails on that)
        pass
    registry = run_dir / "services.json"
    for entry in (json.loads(registry.read_text()).values() if registry.exists() else []):
        try:
            os.kill(entry["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_job_resumes_from_its_folder_and_trains_every_acked_sample_once(tmp_path):
    run_dir = tmp_path / "run"
    job = relayrl("run", str(experiment_file(tmp_path)), start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        # Killed between checkpoints, once RL has run a while: the steps after the checkpoint are lost.
        while (rl_seconds(run_dir) < KILL_AFTER_S or not (steps := steps_so_far(run_dir))[0]
               or steps[1] <= steps[0]):
            assert job.poll() is None, f"the run ended before the kill:\n{job.stdout.read()}"
            assert time.monotonic() < deadline, f"not {KILL_AFTER_S} s of RL and a step past a checkpoint in 180 s"
            time.sleep(0.05)
    finally:
        kill_the_job(job, run_dir)
    saved_step, last_step = steps_so_far(run_dir)
    saved = json.loads((latest_checkpoint(run_dir / "checkpoints") / STATE_FILE).read_text())
    before = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    spent = rl_seconds(run_dir)
    position = run_dir / "driver_position.json"
    stored_before = json.loads(position.read_text())["next"] if position.exists() else 0
    assert not (run_dir / "summary.json").exists()

    resumed = relayrl("run", "--resume", str(run_dir))
    output, _ = resumed.communicate(timeout=200)
    assert resumed.returncode == 0, output
    assert "resuming RL at" in output, output

    # The run completed: its summary and export, its RL clock counting the seconds before the kill.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (run_dir / "export" / "config.json").exists()
    assert BUDGET_S - 1 <= summary["rl_seconds"] < BUDGET_S + 30, (summary["rl_seconds"], spent)
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [p["elapsed_s"] for p in curve] == sorted(p["elapsed_s"] for p in curve)
    assert sum(p["elapsed_s"] == 0 for p in curve) == 1, "the resumed run evaluated a second start"

    # The trainer went on after its checkpoint's step, not from step 1; versions kept growing.
    records = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    after = records[len(before):]
    assert after[0]["step"] == saved_step + 1, (saved_step, after[0]["step"])
    assert after[-1]["step"] > last_step
    assert after[0]["weight_version"] > max(r["weight_version"] for r in before) >= saved["weight_version"]
    history, discounted = final_history(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in history] == list(range(1, len(history) + 1))
    assert discounted == last_step - saved_step  # the steps lost with the killed trainer
    versions = [r["weight_version"] for r in history]
    assert versions == sorted(set(versions)), "weight versions went back"

    # No sample trained twice in the final model's history; the buffer acked each sample once, all trained.
    trained = Counter(i for record in history for i in record["sample_ids"])
    assert trained and max(trained.values()) == 1, [i for i, n in trained.items() if n > 1][:8]
    acks = ack_counts(run_dir / "buffer")
    assert acks and max(acks.values()) == 1, [i for i, n in acks.items() if n > 1][:8]
    assert set(acks) <= set(trained)
    _, acked, _ = read_buffer_log(run_dir / "buffer")
    assert acked == set(acks)

    # Two drivers ran the prompt stream under two producer ids, the second on from the first's position.
    position = json.loads((run_dir / "driver_position.json").read_text())
    assert len(set(position["producer_ids"])) == 2 and position["next"] >= stored_before

    again = relayrl("run", "--resume", str(run_dir))
    output, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and "finished already" in output, output


def ack_counts(data_dir: pathlib.Path) -> Counter:
    """How many ack records of the buffer's log name each sample id."""
    from services.buffer.log import SEGMENT_SUFFIX, RecordKind, scan
    from services.buffer.records import decode_ids

    counts: Counter = Counter()
    for path in sorted(data_dir.glob(f"*{SEGMENT_SUFFIX}")):
        records, _ = scan(memoryview(path.read_bytes()), int(path.name.removesuffix(SEGMENT_SUFFIX)))
        counts.update(i for record in records if record.kind == RecordKind.ACK for i in decode_ids(record.payload))
    return counts


def test_resume_refuses_what_is_not_a_run(tmp_path, capsys):
    assert cli(["run", "--resume", str(tmp_path)]) == 2
    assert "is not a run folder (no config.yaml)" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("just text\n")
    assert cli(["run", "--resume", str(tmp_path)]) == 2
    assert "holds no run config" in capsys.readouterr().err
    assert cli(["run", "--resume", str(tmp_path), "--set", "seed=1"]) == 2
    assert "give no experiment file or --set" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("seed: 0\n")  # what the former built-in quickstart job recorded
    assert cli(["run", "--resume", str(tmp_path)]) == 2
    assert "only the run of an experiment file can be resumed" in capsys.readouterr().err


def test_resume_of_a_finished_run_says_so(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "summary.json").write_text("{}\n")
    assert cli(["run", "--resume", str(tmp_path)]) == 0
    assert "finished already" in capsys.readouterr().out
