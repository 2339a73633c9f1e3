"""A torchrun job of one torchrun per node (deploy/local/node_job.py, a trainer across Ray nodes) as one supervised member:
real processes (deploy.local.supervisor.Process, what each Ray agent holds: `python -c`, and a real torchrun) stand as its
nodes, and the local launcher's real Supervisor watches it. No Ray: tests/test_ray_launcher.py runs it on a cluster."""

import os
import pathlib
import signal
import time

import pytest

from deploy.experiment.sections import SuperviseConfig
from deploy.local.node_job import NodeJob
from deploy.local.supervisor import Process, Supervisor

SLEEP = "import time; time.sleep(60)"


def nodes(tmp_path, *codes: str) -> list[Process]:
    """One Process per node running `python -c CODE`, logging to node<i>.log."""
    return [Process(f"node{i}", ["-c", code], tmp_path / f"node{i}.log") for i, code in enumerate(codes)]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.05)
    return value


@pytest.fixture
def started():
    jobs: list[NodeJob] = []

    def start(job: NodeJob) -> NodeJob:
        jobs.append(job)
        job.start(10)
        return job

    yield start
    for job in jobs:
        job.kill()


def test_one_node_failing_kills_the_others_and_is_the_jobs_exit_code(tmp_path, started):
    job = started(NodeJob("trainer", nodes(tmp_path, SLEEP, "import sys; print('rank 1 lost its peer'); sys.exit(3)",
                                           SLEEP)))
    assert wait_for(lambda: job.exit_code(), 30, "the job's exit code") == 3
    first, failing, third = job.nodes
    assert first.exit_code() == third.exit_code() == -15  # ended with it (SIGTERM), not left waiting
    assert job.exit_code() == 3  # the failing node's code stays the job's, not the ended nodes' -15
    assert "rank 1 lost its peer" in job.log_tail() and job.log_path == failing.log_path


def test_the_job_runs_while_any_node_runs_and_is_done_when_all_exited_zero(tmp_path, started):
    release = tmp_path / "release"
    wait = f"import pathlib, time\nwhile not pathlib.Path({str(release)!r}).exists(): time.sleep(0.05)"
    job = started(NodeJob("trainer", nodes(tmp_path, "pass", wait)))
    wait_for(lambda: job.nodes[0].exit_code() == 0, 30, "node 0 done")
    assert job.exit_code() is None  # node 1 still runs
    release.touch()
    assert wait_for(lambda: job.exit_code() == 0, 30, "every node done")
    assert job.pid == job.nodes[0].pid and job.log_path == job.nodes[0].log_path


def test_stop_and_kill_reach_every_node(tmp_path, started):
    job = started(NodeJob("trainer", nodes(tmp_path, SLEEP, SLEEP)))
    job.stop(5)
    assert [node.exit_code() for node in job.nodes] == [-15, -15]
    job.start(10)
    assert job.exit_code() is None and job.failed is None  # a new start forgets the last one's end
    job.kill()
    assert [node.exit_code() for node in job.nodes] == [-15, -15]


def test_a_kill_ends_torchruns_ranks_too(tmp_path, started):
    """torchrun starts its ranks in sessions of their own: SIGKILLing torchrun alone would leave them running."""
    pids = tmp_path / "ranks"
    script = tmp_path / "rank.py"
    script.write_text(f"import os, pathlib, time\n"  # the file's name carries the pid: made at once, never half written
                      f"pathlib.Path({str(pids)!r}, f\"{{os.environ['RANK']}}-{{os.getpid()}}\").touch()\n"
                      "time.sleep(120)\n")
    pids.mkdir()
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    job = started(NodeJob("trainer", [Process("trainer", torchrun, tmp_path / "trainer.log")]))
    wait_for(lambda: len(list(pids.iterdir())) == 2, 90, "both ranks started")
    ranks = [int(path.name.split("-")[1]) for path in pids.iterdir()]
    try:
        assert all(running(pid) for pid in ranks) and job.exit_code() is None
        job.kill()
        wait_for(lambda: not any(running(pid) for pid in ranks), 10, "the ranks ended")
        assert job.nodes[0].exit_code() is not None
    finally:
        for pid in filter(running, ranks):  # what a failed kill left: this test's own rank processes, by pid
            os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    stat = pathlib.Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_supervisor_restarts_the_whole_job_when_one_node_fails(tmp_path):
    """The local restart policy: node 1 fails on its first start; node 0 (which would wait forever on it) is
    killed, and both start again, after which the job finishes and is done, one restart counted."""

    def node(index: int, first_start: str) -> str:
        starts = tmp_path / f"starts{index}"
        return (f"import pathlib, sys, time\np = pathlib.Path({str(starts)!r})\nfirst = not p.exists()\n"
                f"p.write_text(p.read_text() + 'x' if p.exists() else 'x')\nif first:\n    {first_start}")

    supervisor = Supervisor(SuperviseConfig(backoff_s=0.1, max_restarts=2))
    try:
        job = supervisor.add(NodeJob("trainer", nodes(tmp_path, node(0, "time.sleep(60)"), node(1, "sys.exit(5)")),
                                     exit_zero_is_done=True))
        wait_for(lambda: supervisor.done("trainer"), 60, "the job done after one restart")
    finally:
        supervisor.stop()
    assert supervisor.restarts() == {"trainer": 1}
    assert "exited with code 5" in supervisor.records["trainer"].deaths[0][1]
    assert [(tmp_path / f"starts{i}").read_text() for i in (0, 1)] == ["xx", "xx"]  # both nodes started twice
    assert job.exit_code() == 0
