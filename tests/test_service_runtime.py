"""The runtime around a real service process: health, reflection, CLI, bad input, graceful SIGTERM."""

import asyncio
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import reward_pb2, reward_pb2_grpc
from protos.codec import encode_array
from protos.sample import Sample
from services.client import connect


@pytest.fixture
def reward_service(service_factory):
    return service_factory("reward", {
        "functions": {"slow": {"target": "tests.slow_reward:score"}},
        "server.grace_s": 8,
        "server.metrics_port": 0,
    })


def _sample(i: int = 0) -> Sample:
    return Sample(sample_id=f"s{i}", prompt_id="p", prompt_ids=np.array([1, 5], np.int32),
                  response_ids=np.array([7], np.int32), loss_mask=np.ones(1, np.uint8),
                  rollout_logprobs=np.zeros(1, np.float32), weight_versions=np.zeros(1, np.int64),
                  response_text="4", metadata={"answer": "4"})


def test_health_cli_reflection_and_metrics(reward_service):
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "health", reward_service.address],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "SERVING", out.stderr

    with grpc.insecure_channel(reward_service.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {"relayrl.reward.v1.Reward", "grpc.health.v1.Health"} <= names
        reward_pb2_grpc.RewardStub(channel).ListFunctions(reward_pb2.ListFunctionsRequest(), timeout=10)

    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{reward_service.metrics_port}/metrics", timeout=10).read().decode()
    assert 'relayrl_rpc_handled_total{code="OK",method="ListFunctions",service="relayrl.reward.v1.Reward"}' in text


def test_metrics_are_served_on_the_services_own_address(service_factory):
    """A service bound to a node's address (as on Ray or a cluster) is scraped there, not only on loopback."""
    import socket
    import urllib.request

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 1))  # no packet is sent: it only picks the interface of the default route
        host = probe.getsockname()[0]
    except OSError:
        pytest.skip("this machine has no address besides loopback")
    finally:
        probe.close()
    if host.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    service = service_factory("reward", {"server.address": f"{host}:0", "server.insecure": True,
                                         "server.metrics_port": 0})
    text = urllib.request.urlopen(f"http://{host}:{service.metrics_port}/metrics", timeout=10).read().decode()
    assert "relayrl_rpc_started_total" in text or "python_info" in text


def test_health_cli_reports_an_unreachable_address(free_port):
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "health", f"127.0.0.1:{free_port}", "--timeout", "1"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_malformed_request_gets_invalid_argument_and_the_server_keeps_serving(reward_service):
    with grpc.insecure_channel(reward_service.address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        bad = _sample().to_proto()
        bad.response_ids.CopyFrom(encode_array([1, 2, 3], "int32"))
        bad.response_ids.length = 7  # the bytes do not hold 7 int32
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(reward_pb2.ScoreRequest(samples=[bad], function="exact_match"), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "samples[0].response_ids" in err.value.details()
        reply = stub.Score(reward_pb2.ScoreRequest(samples=[_sample().to_proto()], function="exact_match"), timeout=60)
        assert reply.results[0].reward == 1.0


async def test_sigterm_lets_the_in_flight_call_finish_within_the_grace_period(reward_service):
    async with connect(reward_service.address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        # Warm the worker so the slow call's time is the function's own.
        await stub.Score(reward_pb2.ScoreRequest(samples=[_sample().to_proto()], function="exact_match"), timeout=60)
        call = stub.Score(reward_pb2.ScoreRequest(samples=[_sample().to_proto()], function="slow"), timeout=60)
        await asyncio.sleep(0.5)  # the call is in flight
        started = time.monotonic()
        reward_service.proc.terminate()
        reply = await call
        assert reply.results[0].reward == 1.0 and reply.results[0].reason == ""
        code = await asyncio.to_thread(reward_service.proc.wait, 20)
        assert code == 0
        assert time.monotonic() - started < 8, "stopping took longer than the grace period"


def test_bytes_that_do_not_parse_get_invalid_argument(reward_service):
    with grpc.insecure_channel(reward_service.address) as channel:
        raw = channel.unary_unary("/relayrl.reward.v1.Reward/Score")  # no serializer: raw bytes
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff", timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request does not parse" in err.value.details()
        reward_pb2_grpc.RewardStub(channel).ListFunctions(reward_pb2.ListFunctionsRequest(), timeout=10)
