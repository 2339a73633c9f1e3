"""The pipeline across hosts: three network namespaces joined by veth pairs through a bridge, each service bound
to its own address; weights sync across them, a link is cut and restored, and the run goes on.

    host "roll":  the rollout service (its weight receiver joins the trainer's gloo group from here)
    host "train": the trainer (its rendezvous store and gloo endpoint bind this host's address)
    host "svc":   buffer, reward and the driver

Real processes, real gRPC between namespaces, a real gloo group; needs root (skipped otherwise).
"""

import json
import pathlib
import re
import time

import pytest

from deploy.experiment.sections import SuperviseConfig
from deploy.experiment.tasks import arithmetic_tasks, write_jsonl
from deploy.rl.config import Addresses, Pipeline, RLConfig, driver_config, trainer_config
from deploy.rl.pipeline import write_yaml
from rollout.driver.producer import WATCH_S

netns_kit = pytest.importorskip("netns_kit")
_why_not = netns_kit.available()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")

PUBLISH_TIMEOUT_S = 20.0  # the trainer's deadline for rendezvous + transfer of one publish
CONTROL_TIMEOUT_S = 5.0  # its deadline per control call to the rollout (BeginUpdate, CommitUpdate's switch, ...)
RPC_TIMEOUT_S = 5.0  # the driver's deadline per call
MAX_STEPS = 1000  # far more than run before the cut: at ~40 steps/s a cap of 40 was reached before the link was cut
SLACK_S = 15.0  # a loaded 2-core machine


@pytest.fixture
def hosts():
    made = netns_kit.Hosts(["roll", "train", "svc"])
    yield made
    made.close()


def records(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(condition, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for name, proc in procs:
            assert proc.poll() is None, f"{name} exited with {proc.returncode} while waiting for {what}"
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.2)


def serve(hosts, host: str, name: str, port: int, logs: pathlib.Path, *settings: str):
    address = f"{hosts.addresses[host]}:{port}"
    proc = hosts.spawn(host, ["-m", "deploy.cli", "serve", name, "--address", address, "--insecure",
                              *(arg for s in settings for arg in ("--set", s))], logs / f"{name}.log")
    return address, proc


def healthy(hosts, address: str) -> bool:
    return hosts.run("svc", ["-m", "deploy.cli", "health", address, "--timeout", "2"]).returncode == 0


def test_a_weight_group_spans_three_hosts(hosts, tmp_path):
    """Gloo's group is a full mesh: every receiver must bind an address the other receivers reach (gloo's own
    default here is the hostname's, 127.0.0.1, and two receivers on two hosts never connected)."""
    port_file = tmp_path / "store.port"
    members = [hosts.spawn(host, ["tests/netns_weight_member.py", hosts.addresses["roll"], str(port_file), str(rank),
                                  "3"], tmp_path / f"{host}.log")
               for rank, host in enumerate(["roll", "train", "svc"])]
    deadline = time.monotonic() + 90
    while any(proc.poll() is None for proc in members) and time.monotonic() < deadline:
        time.sleep(0.2)
    outputs = [(tmp_path / f"{host}.log").read_text() for host in ["roll", "train", "svc"]]
    for rank, output in enumerate(outputs):
        assert f"rank {rank} received 120" in output, output[-2000:]


@pytest.mark.slow
def test_weights_sync_across_hosts_and_a_cut_link_is_reported_then_the_run_resumes(hosts, tiny_model_dir, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    buffer, buffer_proc = serve(hosts, "svc", "buffer", 50051, logs, f"data_dir={tmp_path / 'buffer'}",
                                "max_staleness=1", "capacity=512")
    reward, reward_proc = serve(hosts, "svc", "reward", 50052, logs)
    rollout, rollout_proc = serve(hosts, "roll", "rollout", 50053, logs, f"model={tiny_model_dir}")
    services = [("buffer", buffer_proc), ("reward", reward_proc), ("rollout", rollout_proc)]
    for address in (buffer, reward, rollout):
        wait_for(lambda address=address: healthy(hosts, address), 120, f"{address} SERVING from the svc host",
                 services)

    plan = Pipeline(
        run_dir=tmp_path, policy_dir=tiny_model_dir,
        prompts_path=write_jsonl(arithmetic_tasks(digits=1), tmp_path / "prompts.jsonl"), seed=0,
        rl=RLConfig(group_size=4, groups_per_batch=4, max_staleness=1, max_tokens=2, max_steps=MAX_STEPS,
                    checkpoint_interval=5),
        supervise=SuperviseConfig(), evaluate=lambda addresses: 0.0,
        driver={"rpc_timeout_s": RPC_TIMEOUT_S},
        trainer={"publish": {"master_addr": hosts.addresses["train"], "control_timeout_s": CONTROL_TIMEOUT_S,
                             "timeout_s": PUBLISH_TIMEOUT_S}},
    )
    addresses = Addresses(buffer=buffer, reward=reward, rollout=rollout)
    driver_cfg = write_yaml(tmp_path / "driver.yaml", driver_config(plan, addresses))
    trainer_cfg = write_yaml(tmp_path / "trainer.yaml", trainer_config(plan, addresses))
    trainer = hosts.spawn("train", ["-m", "trainer", "--config", str(trainer_cfg)], logs / "trainer.log")
    driver = hosts.spawn("svc", ["-m", "rollout.driver", "--config", str(driver_cfg)], logs / "driver.log")
    members = [*services, ("trainer", trainer), ("driver", driver)]
    steps = lambda: records(tmp_path / "trainer_metrics.jsonl")
    stats = lambda: records(tmp_path / "driver_stats.jsonl")
    trainer_log = lambda: (logs / "trainer.log").read_text(errors="replace")
    unreachable = re.compile(rf"{re.escape(rollout)}.*(DEADLINE_EXCEEDED|UNAVAILABLE)")
    driver_warnings = lambda: re.findall(r"WARNING .*(?:GenerateMany|GetWeightVersion): (?:DEADLINE_EXCEEDED|"
                                         r"UNAVAILABLE)", (logs / "driver.log").read_text(errors="replace"))

    # Weights cross hosts: the rollout serves versions the trainer published over gloo from another namespace.
    wait_for(lambda: len(steps()) >= 8 and stats() and stats()[-1]["version"] >= 3, 240,
             "8 steps and the rollout serving weight version 3", members)

    assert unreachable.search(trainer_log()) is None and not driver_warnings()
    hosts.cut("roll")
    cut_at, cut_step = time.monotonic(), len(steps())
    # The trainer reports the unreachable receiver within its deadlines and keeps running: a publish caught
    # mid-transfer fails at its transfer deadline plus the commit's control deadline, one begun during the cut at
    # BeginUpdate's. The driver's calls to the rollout fail at their deadline, are logged and retried.
    wait_for(lambda: unreachable.search(trainer_log()) is not None, PUBLISH_TIMEOUT_S + CONTROL_TIMEOUT_S + SLACK_S,
             "the trainer reporting the rollout unreachable", members)
    trainer_reported_s = time.monotonic() - cut_at
    # Held back by admission, the driver waits on a GetWeightVersion watch (its deadline WATCH_S + 10 s); the poll
    # that follows it fails at the driver's own deadline.
    wait_for(driver_warnings, WATCH_S + 10 + RPC_TIMEOUT_S + SLACK_S,
             "the driver reporting its calls to the rollout failing", members)
    driver_reported_s = time.monotonic() - cut_at
    time.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))
    stalled_step = len(steps())
    assert stalled_step - cut_step <= 4, "steps went on without the rollout: the cut did not cut"
    assert trainer.poll() is None and driver.poll() is None

    hosts.restore("roll")
    version_at_restore = stats()[-1]["version"]
    wait_for(lambda: trainer.poll() is not None, 240, f"the trainer reaching step {MAX_STEPS}",
             [m for m in members if m[0] != "trainer"])
    assert trainer.returncode == 0, trainer_log()[-3000:]
    assert len(steps()) == MAX_STEPS and steps()[-1]["step"] == MAX_STEPS
    wait_for(lambda: stats()[-1]["version"] > version_at_restore, 30, "the rollout serving weights published after "
             "the link came back", [m for m in members if m[0] != "trainer"])  # the trainer is done
    print(f"netns: reported by the trainer after {trainer_reported_s:.1f}s, the driver {driver_reported_s:.1f}s; "
          f"steps {cut_step} at the cut, {stalled_step} 30s later, {MAX_STEPS} at the end; rollout version "
          f"{version_at_restore} -> {stats()[-1]['version']}")
