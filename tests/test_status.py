"""`relayrl status`: every service of a run in one table, from real service processes on loopback."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from buffer_samples import sample_proto

from deploy.record.service_registry import REGISTRY_FILE
from deploy.record.status import StatusPoller, Target
from protos import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import encode_array
from services.client import connect_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def run(tmp_path, service_factory, tiny_model_dir):
    """A run folder whose buffer, reward and rollout record themselves in services.json, as `relayrl run` does."""
    registry = tmp_path / REGISTRY_FILE
    stages = {"server.stage_reports": {"dir": str(tmp_path / "stages"), "interval_s": 0.2}}  # as plan.py sets it
    services = {
        "buffer": service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": 2},
                                  registry=registry),
        "reward": service_factory("reward", stages, registry=registry),
        "rollout": service_factory("rollout", {"model": str(tiny_model_dir), **stages}, registry=registry),
    }
    return tmp_path, services


def relayrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], check=False, capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def generate(address: str, tokens: int) -> None:
    with connect_sync(address) as channel:
        rollout_pb2_grpc.RolloutStub(channel).Generate(rollout_pb2.GenerateRequest(
            prompt_ids=encode_array(np.array([1, 2, 3], np.int32), "int32"),
            params=rollout_pb2.SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)), timeout=60)


def test_the_run_folder_records_every_service_with_its_metrics_port(run):
    run_dir, services = run
    recorded = json.loads((run_dir / REGISTRY_FILE).read_text())
    assert set(recorded) == {"buffer", "reward", "rollout"}
    for name, service in services.items():
        assert recorded[name]["address"] == service.address
        assert recorded[name]["metrics_port"] == service.metrics_port is not None
        assert recorded[name]["pid"] == service.pid


def test_status_reads_every_field_of_every_service(run):
    _, services = run
    targets = [Target(name, s.address, name, s.metrics_port) for name, s in services.items()]
    poller = StatusPoller(lambda: targets)
    poller.refresh()
    with connect_sync(services["buffer"].address) as channel:
        buffer = buffer_pb2_grpc.BufferStub(channel)
        buffer.SetVersion(buffer_pb2.SetVersionRequest(version=3), timeout=10)
        buffer.Put(buffer_pb2.PutRequest(samples=[sample_proto(f"s{i}", version=3) for i in range(6)]), timeout=10)
        buffer.Put(buffer_pb2.PutRequest(samples=[sample_proto("old", version=0)]), timeout=10)  # 3 behind: stale
        batches = list(buffer.Pull(buffer_pb2.PullRequest(batch_size=2, max_batches=1, allow_partial_groups=True),
                                   timeout=10))  # read to its end: a stream left open is the client's cancel
        assert [len(batch.samples) for batch in batches] == [2]
    generate(services["rollout"].address, tokens=16)
    with connect_sync(services["rollout"].address) as channel, pytest.raises(grpc.RpcError):
        rollout_pb2_grpc.RolloutStub(channel).Generate(rollout_pb2.GenerateRequest(), timeout=10)  # no prompt
    rows = {row.name: row for row in poller.refresh()}

    assert all(row.up and row.health == "SERVING" and row.metrics == "on" for row in rows.values())
    buffer = rows["buffer"]
    assert buffer.kind == "buffer" and buffer.address == services["buffer"].address
    assert buffer.weight_version == 3
    assert buffer.queue == {"ready": 4, "leased": 2}
    assert buffer.staleness == {"max_staleness": 2, "dropped_stale": 1}
    assert buffer.throughput["put"] > 0 and buffer.throughput["acked"] == 0 and buffer.throughput["rpcs"] > 0
    assert buffer.errors == {"total": 0, "by_code": {}}

    rollout = rows["rollout"]
    assert rollout.weight_version == 0 and rollout.queue == {"running": 0, "waiting": 0}
    assert rollout.throughput["tokens"] > 0 and rollout.throughput["rpcs"] > 0
    assert rollout.errors == {"total": 1, "by_code": {"INVALID_ARGUMENT": 1}}
    assert rollout.staleness is None

    reward = rows["reward"]
    assert reward.weight_version is None and reward.queue == {} and reward.errors == {"total": 0, "by_code": {}}
    assert reward.throughput == {"rpcs": 0.0, "scored": 0.0}


def test_a_pull_stream_its_client_cancels_is_counted_cancelled_not_an_error(run):
    """A trainer pulls with max_batches 0 (until it cancels) and hangs up when it stops: the buffer counted that as
    UNKNOWN, an error in `relayrl status` (and a flake of the test above, whose stream was closed unread)."""
    _, services = run
    buffer_service = services["buffer"]
    with connect_sync(buffer_service.address) as channel:
        buffer = buffer_pb2_grpc.BufferStub(channel)
        buffer.Put(buffer_pb2.PutRequest(samples=[sample_proto(f"s{i}") for i in range(2)]), timeout=10)
        stream = buffer.Pull(buffer_pb2.PullRequest(batch_size=2, max_batches=0, allow_partial_groups=True),
                             timeout=30)
        assert len(next(stream).samples) == 2
        stream.cancel()  # the server is waiting for a second batch
    page = f"http://127.0.0.1:{buffer_service.metrics_port}/metrics"
    handled = 'relayrl_rpc_handled_total{code="%s",method="Pull",service="relayrl.buffer.v1.Buffer"}'
    deadline = time.monotonic() + 30
    while handled % "CANCELLED" not in (text := urllib.request.urlopen(page, timeout=10).read().decode()):
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "handled_total" in line]
        time.sleep(0.1)
    assert handled % "UNKNOWN" not in text
    target = Target("buffer", buffer_service.address, "buffer", buffer_service.metrics_port)
    assert StatusPoller(lambda: [target]).refresh()[0].errors == {"total": 0, "by_code": {}}


def test_relayrl_status_of_a_run_folder_prints_one_json_object(run):
    run_dir, services = run
    generate(services["rollout"].address, 8)
    time.sleep(0.5)  # the engine's next stage report holds the request
    result = relayrl("status", str(run_dir), "--json", "--interval", "0.2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["down"] == []
    # where the time went, from the rollout's and the reward's stage reports (deploy/record/performance.py)
    perf = report["performance"]
    assert perf["trainer"] is None and perf["reward"]["stages"]["idle"]["share"] > 0.9
    assert perf["rollout"]["prefill_tokens"] == 3 and perf["rollout"]["decode_tokens"] == 7
    assert sum(stage["share"] for stage in perf["rollout"]["stages"].values()) == pytest.approx(1.0)
    table = relayrl("status", str(run_dir), "--interval", "0.2")
    assert "where the time went" in table.stdout and "decode" in table.stdout, table.stdout
    rows = {row["name"]: row for row in report["services"]}
    assert set(rows) == set(services)
    for name, row in rows.items():
        assert row["kind"] == name and row["address"] == services[name].address and row["health"] == "SERVING"
        assert set(row) >= {"weight_version", "queue", "staleness", "throughput", "errors"}
        assert row["errors"]["total"] == 0
    assert rows["rollout"]["weight_version"] == 0 and rows["buffer"]["weight_version"] == -1
    assert rows["buffer"]["queue"] == {"ready": 0, "leased": 0} and set(rows["rollout"]["queue"]) == {"running",
                                                                                                        "waiting"}


def test_an_address_that_is_down_is_a_row_and_a_nonzero_exit(run, free_port):
    _, services = run
    buffer, rollout = services["buffer"], services["rollout"]
    down = f"127.0.0.1:{free_port}"
    result = relayrl("status", buffer.address, f"{rollout.address}/{rollout.metrics_port}", down, "--json",
                     "--interval", "0.2")
    assert result.returncode == 1
    rows = {row["address"]: row for row in json.loads(result.stdout)["services"]}
    assert rows[buffer.address]["kind"] == "buffer" and rows[buffer.address]["up"]  # probed by reflection
    assert rows[buffer.address]["errors"] is None and rows[buffer.address]["metrics"] == "off"  # no port given
    assert rows[rollout.address]["kind"] == "rollout" and rows[rollout.address]["metrics"] == "on"
    assert rows[down]["health"] == "UNREACHABLE" and not rows[down]["up"] and "UNAVAILABLE" in rows[down]["problem"]

    table = relayrl("status", buffer.address, down, "--interval", "0.2")
    assert table.returncode == 1
    lines = table.stdout.splitlines()
    assert any(buffer.address in line and "SERVING" in line for line in lines)
    assert any(down in line and "UNREACHABLE" in line for line in lines)


def test_a_restarted_service_is_recorded_again(run):
    run_dir, services = run
    reward = services["reward"]
    old_pid = reward.pid
    reward.restart(timeout=60)
    recorded = json.loads((run_dir / REGISTRY_FILE).read_text())["reward"]
    assert recorded["pid"] == reward.pid != old_pid
    assert recorded["address"] == reward.address and recorded["metrics_port"] == reward.metrics_port


def test_watch_without_a_terminal_prints_every_refresh(tmp_path, service_factory):
    service_factory("buffer", {"data_dir": str(tmp_path / "buffer")}, registry=tmp_path / REGISTRY_FILE)
    for extra, per_refresh in (([], "relayrl status:"), (["--json"], '"services"')):
        watch = subprocess.Popen([sys.executable, "-m", "deploy.cli", "status", str(tmp_path), "--watch",
                                  "--interval", "0.5", *extra], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": ROOT})
        time.sleep(6)
        watch.send_signal(signal.SIGINT)
        out, _ = watch.communicate(timeout=30)
        assert watch.returncode == 0
        assert out.count(per_refresh) >= 3, out  # not one table at the end: one per refresh
