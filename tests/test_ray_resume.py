"""`relayrl run --resume RUN_DIR --ray ADDRESS`: an experiment run on a Ray cluster, stopped mid-RL, goes on from its
folder on the cluster: its services are placed again on their groups' nodes, the trainer resumes after its
checkpoint's step, the RL clock counts the time before the stop. A one-node cluster carrying every group's resource
keeps it cheap (tests/test_ray_launcher.py covers placement across nodes). Needs the `ray` extra; slow."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from test_resume import ROOT, rl_seconds, steps_so_far
from user_project import write_project

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
GROUPS = {"buffer": "cpu", "reward": "cpu", "rollout": "inference", "trainer": "training"}


@pytest.fixture
def cluster(monkeypatch):
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="rr", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", temp)
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "180000")  # a loaded 2-core machine
    made = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {group: 1 for group in set(GROUPS.values())}, "include_dashboard": False})
    try:
        yield made
    finally:
        made.shutdown()
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def relayrl(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(600)
def test_a_stopped_ray_run_resumes_on_the_cluster(cluster, tmp_path):
    run_dir = tmp_path / "run"
    experiment = write_project(tmp_path / "project", run_dir, time_budget_s=40, max_steps=None)  # the budget alone ends it
    sets = ["groups=[{name: training}, {name: inference}, {name: cpu}]",
            *(f"services.{name}.group={group}" for name, group in GROUPS.items()),
            *(f"services.{name}.settings={{server.insecure: true}}" for name in ("buffer", "reward", "rollout"))]
    args = [arg for s in sets for arg in ("--set", s)]
    job = relayrl("run", str(experiment), "--ray", cluster.address, *args)
    try:
        deadline = time.monotonic() + 300
        while rl_seconds(run_dir) < 10 or not (steps := steps_so_far(run_dir))[0] or steps[1] <= steps[0]:
            assert job.poll() is None, f"the run ended before the stop:\n{job.stdout.read()}"
            assert time.monotonic() < deadline, "not 10 s of RL and a step past a checkpoint in 300 s"
            time.sleep(0.2)
    finally:
        job.send_signal(signal.SIGTERM)  # stops every process it placed, leaves the folder to resume
        job.communicate(timeout=120)
    saved_step, last_step = steps_so_far(run_dir)
    spent = rl_seconds(run_dir)
    before = len((run_dir / "trainer_metrics.jsonl").read_text().splitlines())
    first_placement = json.loads((run_dir / "placement.json").read_text())
    assert not (run_dir / "summary.json").exists()

    refused = relayrl("run", "--resume", str(run_dir), "--ray", cluster.address, "--set", "seed=1")
    assert refused.wait(60) == 2 and "give no experiment file" in refused.stdout.read()

    resumed = relayrl("run", "--resume", str(run_dir), "--ray", cluster.address)
    output, _ = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, output[-5000:]
    assert "resuming RL at" in output, output[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 39 <= summary["rl_seconds"] < 40 + 60 and summary["rl_seconds"] > spent
    records = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    print(f"ray resume: stopped at step {last_step} (checkpoint {saved_step}) after {spent:.1f}s of RL; resumed to "
          f"step {records[-1]['step']}, {summary['rl_seconds']:.1f}s of RL in all")
    # the trainer went on after its checkpoint's step (the steps after it are trained again) and kept training
    assert records[before]["step"] == saved_step + 1 and records[-1]["step"] > saved_step + 1
    # placed again on the cluster: new agents, on the node carrying each group
    placement = json.loads((run_dir / "placement.json").read_text())
    assert set(placement) == set(first_placement) >= set(GROUPS)
    head = cluster.head_node.node_id
    assert all(where["node_id"] == head and where["group"] == GROUPS.get(name, where["group"])
               for name, where in placement.items())
