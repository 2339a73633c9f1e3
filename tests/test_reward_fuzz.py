"""Fuzz: random and malformed requests to every Reward RPC get a chosen status, never a crash.

The service runs as a real process; an unhandled exception in a handler would reach the client
as UNKNOWN, which the test refuses. Afterwards the same process must still score normally.
"""

import math

import grpc
import msgpack
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deploy.local.service_process import start_service
from protos import common_pb2, reward_pb2
from protos.codec import encode_array, pack_metadata
from services.client import connect_sync

SERVICE = "relayrl.reward.v1.Reward"
FUNCTIONS = ["exact_match", "numeric_match", "regex_match", "math_verify", "code_exec"]
VALID_CALLS = [("exact_match", {}), ("exact_match", {"extract": "boxed"}), ("numeric_match", {}),
               ("regex_match", {"pattern": "[0-9]+"}), ("math_verify", {}), ("code_exec", {"timeout_s": 5.0})]
NOT_FUNCTIONS = ["", "nope", "os:system", "reward.match:exact_match", "a:b:c", "exact_match "]
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = start_service("reward", {"max_concurrency": 2, "max_batch_samples": 16},
                        log_dir=tmp_path_factory.mktemp("reward-fuzz"))
    yield svc
    svc.stop(timeout=10)


@pytest.fixture(scope="module")
def channel(service):
    chan = connect_sync(service.address)
    yield chan
    chan.close()


def call(channel: grpc.Channel, method: str, payload: bytes) -> tuple[grpc.StatusCode, bytes | str]:
    """(status, reply bytes or error details)."""
    try:
        return grpc.StatusCode.OK, channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=60)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def assert_undecodable_refused(code: grpc.StatusCode, details: str) -> None:
    """Bytes that are not the request message never reach a handler: the runtime refuses them."""
    assert code == grpc.StatusCode.INVALID_ARGUMENT, code
    assert "request does not parse" in details, details


def parses(message_type, payload: bytes) -> bool:
    try:
        message_type.FromString(payload)
    except DecodeError:
        return False
    return True


wire_arrays = st.one_of(
    st.builds(common_pb2.Array, dtype=st.integers(-3, 10), length=st.integers(0, 2**64 - 1) | st.integers(0, 8),
              data=st.binary(max_size=40)),
    st.integers(0, 6).map(lambda n: encode_array(np.arange(n), "int32")),
    st.just(common_pb2.Array()),
)
msgpack_maps = st.dictionaries(st.sampled_from(["answer", "tests", "pattern", "x"]),
                               st.one_of(st.text(max_size=8), st.integers(), st.lists(st.text(max_size=8), max_size=2)),
                               max_size=3).map(pack_metadata)
metadata = st.one_of(msgpack_maps, st.binary(max_size=16), st.just(msgpack.packb([1, 2])))
fuzzed_samples = st.builds(
    common_pb2.Sample,
    sample_id=st.text(max_size=6), prompt_id=st.text(max_size=6),
    prompt_ids=wire_arrays, response_ids=wire_arrays, loss_mask=wire_arrays, rollout_logprobs=wire_arrays,
    weight_versions=wire_arrays, status=st.integers(-2, 6), response_text=st.text(max_size=30),
    metadata=metadata,
)


@st.composite
def valid_samples(draw) -> common_pb2.Sample:
    """Well-formed samples with random content, so the fuzz reaches the reward functions too."""
    n = draw(st.integers(0, 5))
    return common_pb2.Sample(
        sample_id=draw(st.text(min_size=1, max_size=6)), prompt_id="p",
        response_ids=encode_array(np.arange(n), "int32"), loss_mask=encode_array(np.ones(n), "uint8"),
        rollout_logprobs=encode_array(np.zeros(n), "float32"), weight_versions=encode_array(np.zeros(n), "int64"),
        status=draw(st.integers(1, 4)), response_text=draw(st.text(max_size=30)), metadata=draw(msgpack_maps),
    )


requests = st.builds(
    reward_pb2.ScoreRequest,
    samples=st.lists(valid_samples(), max_size=4) | st.lists(fuzzed_samples, max_size=3),
    function=st.one_of(st.sampled_from(FUNCTIONS), st.sampled_from(FUNCTIONS), st.sampled_from(NOT_FUNCTIONS),
                       st.text(max_size=12)),
    timeout_s=st.one_of(st.sampled_from([0.0, 5.0]), st.sampled_from([0.0, 5.0]),
                        st.sampled_from([-1.0, math.nan, math.inf, -math.inf, 1e300, 601.0])),
    function_args=st.one_of(st.just(b""), st.just(b""), st.binary(max_size=12),
                            st.sampled_from([pack_metadata({"pattern": "a+"}), pack_metadata({"bogus": 1}),
                                             msgpack.packb({1: 2}), msgpack.packb("x"), pack_metadata({"mode": 3})])),
)


@FUZZ
@given(request=requests)
def test_score_fuzzed_messages(channel, request):
    code, reply = call(channel, "Score", request.SerializeToString())
    event(f"{code.name}: {reply[:40] if isinstance(reply, str) else 'scored'}")
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), f"{code} {reply} for {request}"
    if code == grpc.StatusCode.OK:
        results = reward_pb2.ScoreResponse.FromString(reply).results
        assert len(results) == len(request.samples)
        for result in results:
            assert result.status in (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_FAILED)
            assert result.status == common_pb2.SAMPLE_STATUS_COMPLETED or result.reason


@FUZZ
@given(payload=st.binary(max_size=200))
def test_score_random_bytes(channel, payload):
    code, reply = call(channel, "Score", payload)
    if parses(reward_pb2.ScoreRequest, payload):
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, reply)
    else:
        assert_undecodable_refused(code, reply)


@settings(FUZZ, max_examples=40)
@given(samples=st.lists(valid_samples(), min_size=1, max_size=4), call_args=st.sampled_from(VALID_CALLS))
def test_score_wellformed_requests_with_random_content(channel, samples, call_args):
    """Every well-formed request is scored: content problems come back per sample, never as a failed call."""
    function, args = call_args
    request = reward_pb2.ScoreRequest(samples=samples, function=function, function_args=pack_metadata(args))
    code, reply = call(channel, "Score", request.SerializeToString())
    assert code == grpc.StatusCode.OK, (code, reply)
    results = reward_pb2.ScoreResponse.FromString(reply).results
    assert [r.sample_id for r in results] == [s.sample_id for s in samples]
    for result, sample in zip(results, samples):
        if sample.status == common_pb2.SAMPLE_STATUS_FAILED:
            assert result.status == common_pb2.SAMPLE_STATUS_FAILED and result.reason.startswith("not scored")
        assert result.status == common_pb2.SAMPLE_STATUS_COMPLETED or result.reason


@settings(FUZZ, max_examples=30)
@given(payload=st.binary(max_size=64))
def test_list_functions_random_bytes(channel, payload):
    code, reply = call(channel, "ListFunctions", payload)
    if parses(reward_pb2.ListFunctionsRequest, payload):
        assert code == grpc.StatusCode.OK and "exact_match" in reward_pb2.ListFunctionsResponse.FromString(reply).names
    else:
        assert_undecodable_refused(code, reply)


def test_still_serving_after_the_fuzz(service, channel):
    request = reward_pb2.ScoreRequest(function="exact_match", samples=[
        common_pb2.Sample(sample_id="a", prompt_id="p", response_text="4", metadata=pack_metadata({"answer": "4"}),
                          status=common_pb2.SAMPLE_STATUS_COMPLETED)])
    code, reply = call(channel, "Score", request.SerializeToString())
    assert code == grpc.StatusCode.OK and reward_pb2.ScoreResponse.FromString(reply).results[0].reward == 1.0
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING and service.alive()
