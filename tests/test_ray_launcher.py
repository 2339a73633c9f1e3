"""`relayrl run FILE --ray ADDRESS` on a Ray cluster of five nodes on this machine (ray.cluster_utils.Cluster), each
carrying one group's custom resource (two the training group's, two the inference group's), with two rollout replicas
behind the router and the trainer across the two training nodes (services.trainer.nodes=2, one torchrun per node):
every process (each replica, the router, each trainer node) lands on its group's node (Ray's node ids against the
cluster's node table), the two replicas and the two trainer nodes each on distinct nodes, both ranks train in one job,
both replicas generate for the driver, a replica whose node is lost mid-run is replaced on the inference node left, a
replica killed mid-run is restarted on its node, a trainer rank killed mid-run restarts the whole job on both nodes
from its checkpoint, the driver sees none of it, and a short run of the quickstart experiment learns. Then, on a
cluster of its own, a member whose node is lost (not a replica) fails the run at once, by name. Needs the `ray`
extra; marked slow (Ray on 2 cores is heavy)."""

import contextlib
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

# "rollout" is the router; "rollout-1" and "rollout-2" the replicas (deploy/local/replicas.py), each with its own agent;
# "trainer" is the trainer's node rank 0, "trainer-node1" its node rank 1
GROUPS = {"buffer": "cpu", "reward": "cpu", "driver": "cpu", "rollout": "inference", "rollout-1": "inference",
          "rollout-2": "inference", "trainer": "training", "trainer-node1": "training"}


def list_replicas(router: str) -> router_pb2.ListReplicasResponse:
    with grpc.insecure_channel(router) as channel:
        return router_pb2_grpc.ReplicasStub(channel).ListReplicas(router_pb2.ListReplicasRequest(), timeout=30)


def replaced(run_dir, router: str) -> bool:
    """Whether "rollout-3" (the lost replica's replacement) is recorded, routed to by the router, and generating."""
    registry = json.loads((run_dir / "services.json").read_text())
    if "rollout-3" not in registry:
        return False
    routed = {info.address for info in list_replicas(router).replicas if info.state == router_pb2.REPLICA_STATE_ACTIVE}
    return registry["rollout-3"]["address"] in routed and generated_tokens(registry["rollout-3"]) > 0


def back(run_dir, router: str, name: str, old_pid: int) -> bool:
    """Whether replica `name`, killed as `old_pid`, runs again and the router routes to it."""
    entry = json.loads((run_dir / "services.json").read_text()).get(name)
    if entry is None or entry["pid"] == old_pid:
        return False
    infos = {info.address: info for info in list_replicas(router).replicas}
    return entry["address"] in infos and infos[entry["address"]].state == router_pb2.REPLICA_STATE_ACTIVE


def generated_tokens(entry: dict) -> float:
    """relayrl_rollout_generated_tokens_total of the rollout replica a services.json `entry` names (its /metrics is
    on its node's address, as its gRPC server)."""
    host = entry["address"].rsplit(":", 1)[0]
    text = urllib.request.urlopen(f"http://{host}:{entry['metrics_port']}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("relayrl_rollout_generated_tokens_total"))


@pytest.fixture
def make_cluster(monkeypatch):
    """make_cluster(*node_resources) -> a Cluster: a head of group cpu and one node per {group: 1} given (the first
    of each group with one CPU, any further with none: the machine has two cores)."""
    from ray.cluster_utils import Cluster

    # Ray 2.60 turns token auth on and writes under the home directory and /tmp/ray: keep it all in a temp dir.
    temp = tempfile.mkdtemp(prefix="rr", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", temp)
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "180000")  # a loaded 2-core machine
    made = []

    def make(*nodes: dict):
        made.append(Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"cpu": 1},
                                                                   "include_dashboard": False}))
        seen = set()
        for resources in nodes:
            made[0].add_node(num_cpus=0 if set(resources) & seen else 1, resources=resources)
            seen |= set(resources)
        return made[0]

    try:
        yield make
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for cluster in made:
            cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def cluster(make_cluster):
    # the trainer's second node and the second inference node take no CPU (their agents need none)
    return make_cluster({"training": 1}, {"training": 1}, {"inference": 1}, {"inference": 1})


@pytest.mark.timeout(1200)
def test_services_land_on_their_groups_nodes_and_a_short_run_learns(cluster, tmp_path, free_port):
    from deploy.experiment.quickstart import write_project

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
        router = registry["rollout"]["address"]
        listed = list_replicas(router)
        tokens = {name: generated_tokens(registry[name]) for name in ("rollout-1", "rollout-2")}
        placed = json.loads((run_dir / "placement.json").read_text())
        # The replicas' agents are spread over the two inference nodes (Ray's SPREAD); the router's sits on one.
        # The other node, with one replica and no router, is lost: Ray removes it, and its replica's process,
        # which on a real cluster goes with its machine, is SIGKILLed (here it would outlive its raylet).
        lost = next(name for name in ("rollout-1", "rollout-2") if placed[name]["node_id"] != placed["rollout"]["node_id"])
        survivor = {"rollout-1": "rollout-2", "rollout-2": "rollout-1"}[lost]
        lost_node = next(node for node in cluster.worker_nodes if node.node_id == placed[lost]["node_id"])
        ray.init(address=cluster.address)  # the cluster's node table, read while every node is in it
        resources = {node["NodeID"]: node["Resources"] for node in ray.nodes()}
        lost_at = time.monotonic()
        cluster.remove_node(lost_node)
        with contextlib.suppress(ProcessLookupError):  # a process of this test's own cluster, on this machine
            os.kill(registry[lost]["pid"], signal.SIGKILL)
        # The trainer across two nodes is one member: its rank 1, SIGKILLed on its node, ends the whole torchrun
        # job, which is started again on both nodes and resumes from its checkpoint.
        logs = run_dir / "logs"
        rank1 = re.search(r"rank 1 of 2 \(dp 2 x tp 1\) on cpu \(pid (\d+)\)", (logs / "trainer-node1.log").read_text())
        os.kill(int(rank1[1]), signal.SIGKILL)
        # The lost replica is re-placed: "rollout-3" on the inference node left, joined to the router, routed to
        # once it serves the trainer's weights, and generating.
        deadline = time.monotonic() + 300
        while not replaced(run_dir, router):
            assert job.poll() is None and time.monotonic() < deadline, out.read_text()[-5000:]
            time.sleep(1)
        replaced_after = time.monotonic() - lost_at
        relisted = list_replicas(router)
        registry_after_loss = json.loads((run_dir / "services.json").read_text())
        placed_after_loss = json.loads((run_dir / "placement.json").read_text())
        # The local launcher's restart policy through the agents: a replica, SIGKILLed on its node mid-run, is
        # started again by its agent on the same node and address.
        before = registry[survivor]
        os.kill(before["pid"], signal.SIGKILL)
        # Once it serves again, scaling down to one replica drains the newest (rollout-3), stops it, and ends its
        # agent (`relayrl deploy scale` on a Ray run).
        deadline = time.monotonic() + 300
        while not back(run_dir, router, survivor, before["pid"]):
            assert job.poll() is None and time.monotonic() < deadline, out.read_text()[-5000:]
            time.sleep(1)
        down = subprocess.run([sys.executable, "-m", "deploy.cli", "deploy", "scale", "rollout", "1", "--run",
                               str(run_dir)], check=False, capture_output=True, text=True, timeout=300)
        agents_after_down = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                             if actor["name"].endswith("-rollout-3")]
        placed_after_down = json.loads((run_dir / "placement.json").read_text())
        job.wait(900)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert job.returncode == 0, out.read_text()[-5000:]
    print(f"ray: tokens generated by each replica after 20 steps: {tokens}; {lost}'s node lost: rollout-3 routed "
          f"to and generating {replaced_after:.0f}s later")
    assert {info.address for info in listed.replicas} == {registry[n]["address"] for n in ("rollout-1", "rollout-2")}
    assert all(info.state == router_pb2.REPLICA_STATE_ACTIVE for info in listed.replicas)
    assert all(count > 0 for count in tokens.values()), tokens
    # The lost replica's place: a new replica at a new address on the inference node left, in the router's list,
    # in services.json and placement.json; the lost one in none of them.
    new = registry_after_loss["rollout-3"]["address"]
    assert {info.address for info in relisted.replicas} == {registry[survivor]["address"], new}
    assert new != registry[lost]["address"] and lost not in registry_after_loss
    assert placed_after_loss["rollout-3"]["node_id"] == placed["rollout"]["node_id"] and lost not in placed_after_loss
    after = json.loads((run_dir / "services.json").read_text())[survivor]
    assert after["address"] == before["address"] and after["pid"] != before["pid"]
    assert down.returncode == 0 and "removed rollout-3: drained" in down.stdout, down.stdout + down.stderr
    assert "rollout-3" not in placed_after_down and agents_after_down == [], agents_after_down
    # The summary's restarts: the SIGKILLed replica and the trainer job, once each; not the driver (the router hid
    # both replicas' deaths from it), nor the lost replica (replaced, not restarted).
    assert json.loads((run_dir / "summary.json").read_text())["restarts"] == {survivor: 1, "trainer": 1}
    driver = [json.loads(line) for line in (run_dir / "driver_stats.jsonl").read_text().splitlines()]
    assert driver[-1]["failed"] == 0 and len({row["producer_id"] for row in driver}) == 1  # one driver, no loss

    # Where Ray placed each process's agent (the node id Ray's runtime context gave it): on the node carrying its
    # group's resource, as the cluster's own node table said.
    agents = {name: where["node_id"] for name, where in placed.items()}
    assert set(agents) == set(GROUPS)
    for name, group in GROUPS.items():
        assert group in resources[agents[name]], f"{name} ran on a node without {group}: {resources[agents[name]]}"
    assert len({agents["buffer"], agents["rollout"], agents["trainer"], agents["trainer-node1"]}) == 4
    assert agents["rollout-1"] != agents["rollout-2"]  # spread over the two inference nodes
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
    from deploy.cluster.ray_launcher import PlacementError, RayLauncher
    from deploy.experiment.placement import ServicesSection

    ray.shutdown()  # RayLauncher connects on its own
    three = ServicesSection.model_validate({"trainer": {"group": "training", "nodes": 3}})
    with pytest.raises(PlacementError, match="services.trainer.nodes: 3, but the Ray cluster had no 3 distinct nodes "
                                             "with resource 'training' within 5s"):
        RayLauncher(cluster.address, three, place_timeout_s=5)


@pytest.mark.timeout(300)
def test_a_member_whose_node_is_lost_fails_the_run_at_once_naming_it_and_the_node(make_cluster, tmp_path):
    """A process whose Ray node is lost cannot be restarted where it was, and (not a rollout replica) cannot move:
    the supervisor's check() raises RunFailed naming it and the node, within Ray's detection of the node's death,
    and the run's teardown does not trip over the lost agent."""
    from deploy.cluster.ray_launcher import RayLauncher
    from deploy.experiment.placement import ServicesSection
    from deploy.experiment.sections import SuperviseConfig
    from deploy.local.supervisor import RunFailed, Supervisor

    cluster = make_cluster({"training": 1})
    training = next(node for node in cluster.worker_nodes)
    launcher = RayLauncher(cluster.address, ServicesSection.model_validate({"trainer": {"group": "training"}}))
    supervisor = Supervisor(SuperviseConfig(health_timeout_s=600))
    pid_file = tmp_path / "trainer.pid"
    supervisor.add(launcher.process(
        "trainer", ["-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"],
        tmp_path / "trainer.log"))
    try:
        node_ip = launcher.nodes["trainer"][1]
        assert launcher.nodes["trainer"][0] == training.node_id
        while not pid_file.exists():
            time.sleep(0.2)
        supervisor.check()  # it runs
        lost_at = time.monotonic()
        cluster.remove_node(training)
        while supervisor.failure is None:
            assert time.monotonic() - lost_at < 120, "the supervisor never noticed the lost node"
            time.sleep(0.5)
        noticed = time.monotonic() - lost_at
        with pytest.raises(RunFailed, match=rf"trainer lost its Ray node {re.escape(node_ip)} \(node id "
                                            rf"{training.node_id[:12]}\).*cannot be started elsewhere"):
            supervisor.check()
        print(f"ray: a lost node failed the run {noticed:.1f}s after its removal began")
        assert supervisor.restarts() == {}  # not restarted where it was: there is no there
        assert "trainer" not in launcher.placement()
    finally:
        supervisor.stop()  # the lost member's stop is logged, not raised
        launcher.close()
        if pid_file.exists():  # on a real cluster it went with its node; here it may outlive its raylet
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
