"""`relayrl run FILE --ray ADDRESS` on a Ray cluster of four nodes on this machine (ray.cluster_utils.Cluster), each
carrying one group's custom resource (two the training group's), with two rollout replicas behind the router and the
trainer across the two training nodes (services.trainer.nodes=2, one torchrun per node): every process (each replica,
the router, each trainer node) lands on its group's node (Ray's node ids against the cluster's node table), the two
trainer nodes on distinct nodes, both ranks train in one job, both replicas generate for the driver, a replica killed
mid-run is restarted on its node, a trainer rank killed mid-run restarts the whole job on both nodes from its
checkpoint, and a short run of the quickstart experiment learns. Needs the `ray` extra; marked slow (Ray on 2 cores
is heavy)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import pytest

from protos import router_pb2, router_pb2_grpc

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

# "rollout" is the router; "rollout-1" and "rollout-2" the replicas (deploy/replicas.py), each with its own agent;
# "trainer" is the trainer's node rank 0, "trainer-node1" its node rank 1
GROUPS = {"buffer": "cpu", "reward": "cpu", "driver": "cpu", "rollout": "inference", "rollout-1": "inference",
          "rollout-2": "inference", "trainer": "training", "trainer-node1": "training"}


def generated_tokens(metrics_port: int) -> float:
    """relayrl_rollout_generated_tokens_total of the rollout replica exporting /metrics on `metrics_port`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("relayrl_rollout_generated_tokens_total"))


@pytest.fixture
def cluster(monkeypatch):
    from ray.cluster_utils import Cluster

    # Ray 2.60 turns token auth on and writes under the home directory and /tmp/ray: keep it all in a temp dir.
    temp = tempfile.mkdtemp(prefix="rr", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", temp)
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "180000")  # a loaded 2-core machine
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"cpu": 1},
                                                          "include_dashboard": False})
    try:
        made.add_node(num_cpus=1, resources={"training": 1})
        made.add_node(num_cpus=0, resources={"training": 1})  # the trainer's second node (its agent takes no CPU)
        made.add_node(num_cpus=1, resources={"inference": 1})
        yield made
    finally:
        if ray.is_initialized():
            ray.shutdown()
        made.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(1200)
def test_services_land_on_their_groups_nodes_and_a_short_run_learns(cluster, tmp_path, free_port):
    from deploy.quickstart_project import write_project

    experiment = write_project(tmp_path / "project")
    run_dir = tmp_path / "run"
    groups = "[{name: training}, {name: inference}, {name: cpu}]"
    sets = [f"run_dir={run_dir}", "training.time_budget_s=150", "evaluation.every_s=30",
            f"groups={groups}", "checkpoint.export_dir=null", "services.rollout.replicas=2",
            "services.trainer.nodes=2", f"services.trainer.rendezvous_port={free_port}",
            *(f"services.{name}.group={group}" for name, group in GROUPS.items()
              if name in ("buffer", "reward", "rollout", "trainer")),
            # The services bind their node's address (this machine's, not loopback) with auth off, on purpose.
            *(f"services.{name}.settings={{server.insecure: true}}" for name in ("buffer", "reward", "rollout"))]
    out = tmp_path / "run.out"
    with open(out, "wb") as log:
        job = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", str(experiment), "--ray", cluster.address,
                                *(arg for s in sets for arg in ("--set", s))], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    try:
        steps = run_dir / "trainer_metrics.jsonl"
        deadline = time.monotonic() + 600
        while job.poll() is None and time.monotonic() < deadline and (
                not steps.exists() or len(steps.read_text().splitlines()) < 20):
            time.sleep(1)
        # Both replicas serve: the router routes to both, and each has generated tokens (its own /metrics).
        registry = json.loads((run_dir / "services.json").read_text())
        with grpc.insecure_channel(registry["rollout"]["address"]) as channel:
            listed = router_pb2_grpc.ReplicasStub(channel).ListReplicas(router_pb2.ListReplicasRequest(), timeout=30)
        tokens = {name: generated_tokens(registry[name]["metrics_port"]) for name in ("rollout-1", "rollout-2")}
        # The local launcher's restart policy through the agents: a replica, SIGKILLed on its node mid-run, is
        # started again by its agent on the same node and address.
        before = registry["rollout-1"]
        os.kill(before["pid"], signal.SIGKILL)  # a process of this test's own cluster, on this machine
        # The trainer across two nodes is one member: its rank 1, SIGKILLed on its node, ends the whole torchrun
        # job, which is started again on both nodes and resumes from its checkpoint.
        logs = run_dir / "logs"
        rank1 = re.search(r"rank 1 of 2 on cpu \(pid (\d+)\)", (logs / "trainer-node1.log").read_text())
        os.kill(int(rank1[1]), signal.SIGKILL)
        job.wait(900)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert job.returncode == 0, out.read_text()[-5000:]
    print(f"ray: tokens generated by each replica after 20 steps: {tokens}")
    assert {info.address for info in listed.replicas} == {registry[n]["address"] for n in ("rollout-1", "rollout-2")}
    assert all(info.state == router_pb2.REPLICA_STATE_ACTIVE for info in listed.replicas)
    assert all(count > 0 for count in tokens.values()), tokens
    after = json.loads((run_dir / "services.json").read_text())["rollout-1"]
    assert after["address"] == before["address"] and after["pid"] != before["pid"]
    assert "rollout-1 1" in out.read_text() and "trainer 1" in out.read_text()  # the summary's restarts

    # Where Ray placed each process's agent (the node id Ray's runtime context gave it): on the node carrying its
    # group's resource, as the cluster's own node table says.
    ray.init(address=cluster.address)
    resources = {node["NodeID"]: node["Resources"] for node in ray.nodes()}
    agents = {name: where["node_id"] for name, where in json.loads((run_dir / "placement.json").read_text()).items()}
    assert set(agents) == set(GROUPS)
    for name, group in GROUPS.items():
        assert group in resources[agents[name]], f"{name} ran on a node without {group}: {resources[agents[name]]}"
    assert len({agents["buffer"], agents["rollout"], agents["trainer"], agents["trainer-node1"]}) == 4
    assert agents["rollout-1"] == agents["rollout-2"] == agents["rollout"]  # the cluster's one inference node
    # One torchrun job across the two training nodes: each node's rank said where it landed (trainer/run.py), once
    # per start of the job; after rank 1's death both started again, and rank 0 resumed from its checkpoint.
    node0, node1 = (logs / "trainer.log").read_text(), (logs / "trainer-node1.log").read_text()
    assert node0.count("rank 0 of 2") == node1.count("rank 1 of 2") == 2, (node0[-3000:], node1[-3000:])
    assert "resumed from" in node0.split("rank 0 of 2")[2]

    # Addresses came from the placement: the clients were handed the services' node addresses.
    registry = json.loads((run_dir / "services.json").read_text())
    trainer = (run_dir / "trainer.yaml").read_text()
    assert registry["rollout"]["address"] in trainer and registry["buffer"]["address"] in trainer
    # The shipped warm-up (450 SFT steps, held-out ~0.3), then 150 s of RL on a machine shared with other jobs:
    # the mean of the last two evaluations (200 prompts each) must beat the start.
    curve = [json.loads(line)["accuracy"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"ray: held-out {' -> '.join(f'{a:.3f}' for a in curve)}")
    assert len(curve) >= 3 and sum(curve[-2:]) / 2 > curve[0]

    # A trainer on more nodes than its group has (two here) is refused by name once the place timeout passes.
    from deploy.placement import ServicesSection
    from deploy.ray_launcher import PlacementError, RayLauncher

    ray.shutdown()  # RayLauncher connects on its own
    three = ServicesSection.model_validate({"trainer": {"group": "training", "nodes": 3}})
    with pytest.raises(PlacementError, match="services.trainer.nodes: 3, but the Ray cluster had no 3 distinct nodes "
                                             "with resource 'training' within 5s"):
        RayLauncher(cluster.address, three, place_timeout_s=5)
