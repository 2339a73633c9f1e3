"""The reward service as a real process: hostile code scores 0 with a reason, errors get statuses."""

import json
import pathlib
import socket
import tempfile
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_reward_model import write_tiny_reward_model

from deploy.local.service_process import start_service
from protos import common_pb2, reward_pb2, reward_pb2_grpc
from protos.codec import pack_metadata
from protos.sample import Sample
from reward.sandbox import SandboxLimits, run_python
from services.client import connect_sync

COMPLETED, FAILED = common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_FAILED
SANDBOX_TIMEOUT_S = 5.0


def sample_proto(i: int, response: str, prompt: str = "", **metadata) -> common_pb2.Sample:
    empty = np.zeros(0)
    return Sample(f"s{i}", "p0", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                  empty.astype("float32"), empty.astype("int64"), prompt_text=prompt, response_text=response,
                  metadata=metadata).to_proto()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-service")
    model = write_tiny_reward_model(root / "rm")
    svc = start_service("reward", {"max_concurrency": 3, "max_batch_samples": 64, "server.metrics_port": 0,
                                   "reward_models": {"rm": {"path": model, "batch_size": 2},
                                                     "broken_rm": {"path": str(root / "missing")}}},
                        log_dir=root / "logs")
    yield svc
    svc.stop(timeout=10)


@pytest.fixture(scope="module")
def stub(service):
    channel = connect_sync(service.address)
    yield reward_pb2_grpc.RewardStub(channel)
    channel.close()


def assert_still_serving(service, stub) -> None:
    assert service.alive()
    reply = stub.Score(reward_pb2.ScoreRequest(function="exact_match", samples=[sample_proto(0, "7", answer="7")]),
                       timeout=60)
    assert reply.results[0].reward == 1.0 and reply.results[0].status == COMPLETED
    with grpc.insecure_channel(service.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_list_functions(stub):
    names = stub.ListFunctions(reward_pb2.ListFunctionsRequest(), timeout=10).names
    assert {"exact_match", "numeric_match", "regex_match", "math_verify", "code_exec", "rm"} <= set(names)


def test_hostile_code_scores_zero_with_a_reason_and_the_service_keeps_serving(service, stub):
    isolation = run_python({"main.py": "pass"}, "main.py", SandboxLimits()).isolation
    if not (isolation.get("network_cut") and isolation.get("readonly_fs")):
        pytest.skip(f"needs root or unprivileged user namespaces to cut the network (isolation: {isolation})")
    outside = pathlib.Path(tempfile.mkdtemp(prefix="relayrl-outside-"))
    outside.chmod(0o777)  # writable by anyone: only the sandbox can stop the write
    target = outside / "pwned.txt"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        hostile = {
            "loops forever": "while True:\n    pass\ndef solve():\n    return 1",
            "allocates 10 GB": "blob = bytearray(10 * 1024 ** 3)\ndef solve():\n    return 1",
            "forks repeatedly": "import os\nwhile True:\n    os.fork()\ndef solve():\n    return 1",
            "writes outside its directory": f"open({str(target)!r}, 'w').write('x')\ndef solve():\n    return 1",
            "opens a socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n"
                              "def solve():\n    return 1",
        }
        good = "```python\ndef solve():\n    return 1\n```"
        samples = [sample_proto(i, code, tests=["assert solve() == 1"]) for i, code in enumerate([*hostile.values(), good])]
        args = pack_metadata({"timeout_s": SANDBOX_TIMEOUT_S, "cpu_s": 2, "memory_mb": 512})
        start = time.monotonic()
        reply = stub.Score(reward_pb2.ScoreRequest(function="code_exec", samples=samples, function_args=args,
                                                   timeout_s=120), timeout=180)
        elapsed = time.monotonic() - start
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever reached the listener
    assert not target.exists()
    outside.rmdir()
    *bad, ok = reply.results
    assert (ok.reward, ok.status, ok.reason) == (1.0, COMPLETED, "1/1 tests passed")
    for name, result in zip(hostile, bad):
        assert result.reward == 0.0 and result.reason, f"{name}: {result}"
        assert result.status == COMPLETED, f"{name}: the sandbox, not the worker, must end it: {result.reason}"
    # Two rounds of sandboxes at most on 3 workers, each within its wall-clock limit; slack for a loaded CPU.
    assert elapsed < 2 * SANDBOX_TIMEOUT_S + 20, f"scoring took {elapsed:.1f}s"
    reasons = dict(zip(hostile, (r.reason for r in bad)))
    assert "wall-clock timeout" in reasons["loops forever"] or "SIGXCPU" in reasons["loops forever"]
    assert "MemoryError" in reasons["allocates 10 GB"]
    assert "BlockingIOError" in reasons["forks repeatedly"] or "timeout" in reasons["forks repeatedly"]
    assert ok.details["sandbox_network_cut"] == 1.0 and ok.details["sandbox_readonly_fs"] == 1.0
    assert_still_serving(service, stub)


def test_per_sample_timeout_fails_that_sample_only(service, stub):
    samples = [sample_proto(0, "import time\ntime.sleep(600)", tests=["assert True"]),
               sample_proto(1, "x = 1", tests=["assert x == 1"])]
    reply = stub.Score(reward_pb2.ScoreRequest(function="code_exec", samples=samples, timeout_s=5.0,
                                               function_args=pack_metadata({"timeout_s": 60})), timeout=60)
    slow, fast = reply.results
    assert (slow.status, slow.reason, slow.reward) == (FAILED, "timeout after 5s", 0.0)
    assert (fast.status, fast.reward) == (COMPLETED, 1.0)
    assert_still_serving(service, stub)


def expect_invalid(stub, request: reward_pb2.ScoreRequest, match: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert match in info.value.details()


def test_request_errors_get_invalid_argument(service, stub):
    one = [sample_proto(0, "7", answer="7")]
    expect_invalid(stub, reward_pb2.ScoreRequest(function="no_such_function", samples=one),
                   "unknown reward function 'no_such_function'")
    expect_invalid(stub, reward_pb2.ScoreRequest(samples=one), "function: required")
    expect_invalid(stub, reward_pb2.ScoreRequest(function="os:system", samples=one), "not allowed on this server")
    expect_invalid(stub, reward_pb2.ScoreRequest(function="exact_match", samples=one, function_args=b"\xc1"),
                   "function_args: not valid msgpack")
    expect_invalid(stub, reward_pb2.ScoreRequest(function="exact_match", samples=one,
                                                 function_args=pack_metadata({"nope": 1})),
                   "unexpected keyword argument 'nope'")
    expect_invalid(stub, reward_pb2.ScoreRequest(function="exact_match", samples=one, timeout_s=float("nan")),
                   "timeout_s")
    bad = sample_proto(1, "x")
    bad.response_ids.CopyFrom(common_pb2.Array(dtype=common_pb2.DTYPE_INT32, length=4, data=b"\x00" * 3))
    expect_invalid(stub, reward_pb2.ScoreRequest(function="exact_match", samples=[one[0], bad]),
                   "samples[1].response_ids: 3 bytes do not hold 4 int32 elements")
    expect_invalid(stub, reward_pb2.ScoreRequest(function="exact_match", samples=one * 65), "exceed the limit of 64")
    expect_invalid(stub, reward_pb2.ScoreRequest(function="rm", samples=one, function_args=pack_metadata({"path": "/"})),
                   "fixed by the server")
    assert_still_serving(service, stub)


@pytest.mark.slow  # the model worker imports torch and transformers: ~5-20 s on a busy 2-core machine
def test_reward_model_served_by_name(stub):
    samples = [sample_proto(i, text, prompt="Q: ") for i, text in enumerate(["a", "bb", "ccc"])]
    scores = stub.Score(reward_pb2.ScoreRequest(function="rm", samples=samples), timeout=120).results
    assert [r.status for r in scores] == [COMPLETED] * 3 and len({r.reward for r in scores}) == 3
    assert all(r.details["rm_logit"] == r.reward for r in scores)
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(reward_pb2.ScoreRequest(function="broken_rm", samples=samples), timeout=120)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "cannot be prepared" in info.value.details()


def test_metrics_count_scores_and_failures(service, stub):
    stub.Score(reward_pb2.ScoreRequest(function="exact_match", samples=[sample_proto(0, "1", answer="1"),
                                                                        sample_proto(1, "no answer")]), timeout=60)
    info = json.loads(service.port_file.read_text())
    text = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10).read().decode()
    assert 'relayrl_reward_score_count{function="exact_match"}' in text
    assert 'relayrl_reward_failures_total{function="exact_match",kind="error"}' in text
    assert 'relayrl_reward_call_seconds_count{function="exact_match"}' in text
