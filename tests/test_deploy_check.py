"""`relayrl deploy check FILE`: the placement as a table, and a non-zero exit naming the problem."""

import pathlib
import subprocess
import sys

from deploy.experiment.schema import load_experiment
from deploy.inspect.placement_table import rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "examples" / "cluster" / "experiment.yaml"


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "deploy", "check", *args], check=False,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_check_prints_each_service_on_its_group():
    done = _check(str(CLUSTER))
    assert done.returncode == 0, done.stderr
    lines = {line.split("│")[1].strip(): line for line in done.stdout.splitlines() if line.count("│") > 2}
    assert list(lines) == ["buffer", "reward", "rollout", "trainer"]
    assert [c.strip() for c in lines["rollout"].split("│")[2:9]] == [
        "inference", "8", "relayrl.dev/pool=inference", "8", "cpu 8, memory 64Gi, gpus 1", "50053", "plain"]
    assert "2 nodes x 8" in lines["trainer"] and "rendezvous 29400, weights 29500" in lines["trainer"]
    assert "relayrl.dev/pool=cpu" in lines["buffer"] and "cpu 4, memory 16Gi" in lines["buffer"]


def test_a_file_without_groups_is_all_on_this_machine():
    config = load_experiment(ROOT / "examples" / "experiment" / "experiment.yaml")
    assert rows(config) == [
        ("buffer", "-", "1", "this machine", "-", "-", "any free", "plain"),
        ("reward", "-", "1", "this machine", "-", "-", "any free", "plain"),
        ("rollout", "-", "1", "this machine", "-", "-", "any free", "plain"),
        ("trainer", "-", "1 node x 1", "this machine", "-", "-", "weights any free", "-"),
    ]


def test_check_exits_non_zero_naming_the_problem():
    done = _check(str(CLUSTER), "--set", "services.trainer.procs_per_node=16")
    assert done.returncode == 2
    assert "services.trainer.procs_per_node: 16, but group 'training' has 8 devices per node" in done.stderr
    assert "services.reward.group: 'gpu' is not a group" in _check(str(CLUSTER), "--set",
                                                                   "services.reward.group=gpu").stderr
    missing = _check(str(CLUSTER.parent / "missing.yaml"))
    assert missing.returncode == 2 and "missing.yaml" in missing.stderr
