"""The local launcher restarts what dies, and a death it cannot recover from fails the run by name.

Real service processes on loopback, SIGKILLed and SIGSTOPped by their own pids.
"""

import asyncio
import io
import os
import re
import signal
import time

import pytest
from buffer_samples import sample_proto
from rich.console import Console

from deploy.experiment.sections import SuperviseConfig
from deploy.local.service_process import start_service
from deploy.local.supervisor import RunFailed, Supervisor
from protos import buffer_pb2, buffer_pb2_grpc
from services.client import connect

FAST = SuperviseConfig(backoff_s=0.2, health_interval_s=0.5, health_timeout_s=3.0, max_restarts=2)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.1)


async def put_and_count(address: str, samples) -> int:
    async with connect(address) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        if samples:
            await stub.Put(buffer_pb2.PutRequest(samples=samples), timeout=10)
        return (await stub.Stats(buffer_pb2.StatsRequest(), timeout=10)).pending


@pytest.fixture
def supervisor():
    watching = Supervisor(FAST)
    yield watching
    watching.stop()


def test_a_killed_buffer_comes_back_on_its_address_with_its_samples(tmp_path, supervisor):
    buffer = supervisor.add_service(start_service("buffer", {"data_dir": str(tmp_path / "data")},
                                                  log_dir=tmp_path / "logs"))
    address, pid = buffer.address, buffer.pid
    assert asyncio.run(put_and_count(address, [sample_proto(f"s{i}") for i in range(3)])) == 3
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: supervisor.restarts().get("buffer") == 1, 60, "the buffer restarted")
    assert buffer.address == address and buffer.pid != pid
    assert asyncio.run(put_and_count(address, [])) == 3  # recovered from its log in the same data_dir
    supervisor.check()


def test_a_frozen_service_is_killed_and_started_again(tmp_path, supervisor):
    reward = supervisor.add_service(start_service("reward", {}, log_dir=tmp_path / "logs"))
    pid = reward.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: supervisor.restarts().get("reward") == 1, 60, "the frozen reward service restarted")
    finally:
        if reward.pid == pid:
            os.kill(pid, signal.SIGCONT)
    assert reward.pid != pid
    record = supervisor.records["reward"]
    assert "frozen" in record.deaths[0][1]
    supervisor.check()


def test_a_service_that_keeps_dying_fails_the_run_naming_it(tmp_path, supervisor):
    reward = supervisor.add_service(start_service("reward", {}, log_dir=tmp_path / "logs"))
    for restarts in range(FAST.max_restarts + 1):
        wait_for(lambda: reward.alive(), 60, "the reward service running")
        os.kill(reward.pid, signal.SIGKILL)
        if restarts < FAST.max_restarts:
            wait_for(lambda r=restarts: supervisor.restarts().get("reward") == r + 1, 60, "a restart")
    wait_for(lambda: supervisor.failure is not None, 30, "the run failed")
    with pytest.raises(RunFailed, match="^reward exited with code -9.*restarts are exhausted") as failed:
        supervisor.check()
    assert failed.value.name == "reward" and "last lines of" in str(failed.value)


def test_a_client_process_is_restarted_and_a_finished_one_is_not(tmp_path, supervisor):
    crashing = supervisor.add_process("driver", ["-c", "import time; time.sleep(30)"], tmp_path / "driver.log")
    finishing = supervisor.add_process("trainer", ["-c", "pass"], tmp_path / "trainer.log", exit_zero_is_done=True)
    pid = crashing.pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: supervisor.restarts().get("driver") == 1, 30, "the driver restarted")
    wait_for(lambda: supervisor.done("trainer"), 30, "the trainer done")
    assert crashing.pid != pid and finishing.exit_code() == 0 and "trainer" not in supervisor.restarts()
    supervisor.stop_member("driver")
    time.sleep(1.0)
    assert supervisor.restarts().get("driver") == 1  # stopped on purpose: not restarted


def test_a_frozen_client_process_is_found_by_its_heartbeat(tmp_path, supervisor):
    beat = tmp_path / "driver_stats.jsonl"
    touch_forever = f"import pathlib, time\nwhile True:\n    pathlib.Path({str(beat)!r}).touch(); time.sleep(0.5)"
    driver = supervisor.add_process("driver", ["-c", touch_forever], tmp_path / "driver.log", heartbeat=beat)
    wait_for(beat.exists, 30, "the first heartbeat")
    pid = driver.pid
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: supervisor.restarts().get("driver") == 1, 30, "the frozen driver restarted")
    assert driver.pid != pid and "heartbeat" in supervisor.records["driver"].deaths[0][1]
    time.sleep(FAST.health_timeout_s + 1)
    assert supervisor.restarts() == {"driver": 1}  # the restarted one beats: left alone


def test_the_evaluator_waits_for_a_restarted_rollout(tmp_path, supervisor, tiny_model_dir):
    from deploy.rl.evaluation import greedy_completions

    rollout = supervisor.add_service(start_service(
        "rollout", {"model": str(tiny_model_dir), "engine.torch_threads": 1, "engine.max_model_len": 64},
        log_dir=tmp_path / "logs"))
    os.kill(rollout.pid, signal.SIGKILL)
    completions = asyncio.run(greedy_completions(rollout.address, [[1, 5, 6]] * 4, max_tokens=2, retry_for_s=60))
    assert len(completions) == 4 and supervisor.restarts() == {"rollout": 1}


@pytest.mark.timeout(300)
def test_relayrl_run_exits_non_zero_naming_what_keeps_dying(tmp_path, capsys, monkeypatch):
    """Through `relayrl run`'s own entry point: the reward service is SIGKILLed whenever it runs."""
    import threading

    from deploy.experiment.quickstart import write_project
    from deploy.runs import experiment_run

    started: list[Supervisor] = []
    real = experiment_run.run_experiment

    def run_watched(config, console=None, supervisor=None, resume=False, launcher=None):
        started.append(Supervisor(config.supervise))
        return real(config, Console(file=io.StringIO()), started[0], resume, launcher)

    monkeypatch.setattr(experiment_run, "run_experiment", run_watched)
    stop = threading.Event()

    def keep_killing():
        while not stop.is_set():
            member = started[0].members.get("reward") if started else None
            if member is not None and member.exit_code() is None:
                os.kill(member.pid, signal.SIGKILL)
            time.sleep(0.3)

    killer = threading.Thread(target=keep_killing, daemon=True)
    killer.start()
    try:
        code = experiment_run.main(str(write_project(tmp_path / "project")), [
            f"run_dir={tmp_path / 'run'}", "sft.steps=0", "training.time_budget_s=120", "data.num_eval=8",
            "supervise.max_restarts=2", "supervise.backoff_s=0.2"])
    finally:
        stop.set()
    err = capsys.readouterr().err
    assert code == 1
    assert "relayrl run failed: reward " in err and "restarts are exhausted" in err
    assert ": summary" not in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_trainer_is_found_by_its_heartbeat_and_resumes_from_its_checkpoint(tmp_path, supervisor,
                                                                                    tiny_model_dir):
    """The trainer's heartbeat thread stops only with the whole process: SIGSTOPped, it is killed and started
    again, and the new process resumes after the checkpoint the frozen one had written."""
    from test_trainer_loop import BATCH, make_samples, put, records, trainer_overrides

    buffer = supervisor.add_service(start_service("buffer", {"data_dir": str(tmp_path / "buffer"),
                                                             "lease_timeout_s": 2.0}, log_dir=tmp_path / "logs"))
    put(buffer.address, make_samples(20 * BATCH))
    beat, metrics, max_steps = tmp_path / "trainer.heartbeat", tmp_path / "metrics.jsonl", 8
    overrides = trainer_overrides(tiny_model_dir, buffer.address, tmp_path, max_steps, **{
        "checkpoint.interval": "2", "buffer.lease_timeout_s": "2", "metrics_path": str(metrics),
        "heartbeat_path": str(beat), "heartbeat_interval_s": "0.5"})
    trainer = supervisor.add_process("trainer", ["-m", "trainer", *overrides], tmp_path / "trainer.log",
                                     exit_zero_is_done=True, heartbeat=beat)
    latest = tmp_path / "checkpoints" / "latest"
    # The checkpoint is committed on the trainer's background thread, after the step's metrics record.
    wait_for(lambda: (len(records(metrics)) >= 3 and latest.exists()) or trainer.exit_code() is not None, 180,
             "three steps and a committed checkpoint")
    pid = trainer.pid
    os.kill(pid, signal.SIGSTOP)
    frozen_at = latest.read_text()
    wait_for(lambda: supervisor.restarts().get("trainer") == 1, 30, "the frozen trainer restarted")
    assert trainer.pid != pid and "heartbeat" in supervisor.records["trainer"].deaths[0][1]
    wait_for(lambda: supervisor.done("trainer"), 180, "the restarted trainer finished")
    steps = [r["step"] for r in records(metrics)]
    # The restarted process says where it resumed (it may have been frozen right after that checkpoint,
    # with no step recorded beyond it: then the steps just continue).
    resumed_at = re.findall(r"resumed from \S+ at step (\d+)", (tmp_path / "trainer.log").read_text())
    assert resumed_at and f"step_{int(resumed_at[-1]):08d}" == frozen_at and steps[-1] == max_steps
    assert supervisor.restarts() == {"trainer": 1}
    supervisor.check()
