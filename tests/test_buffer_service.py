"""The Buffer service over real gRPC (in-process server, real client): every RPC and its refusals."""

import asyncio
import contextlib

import grpc
import numpy as np
import pytest
from buffer_samples import sample_proto as make_sample

from protos import buffer_pb2, buffer_pb2_grpc, common_pb2
from protos.codec import encode_array
from protos.sample import SampleStatus
from services.buffer.buffer import ReplayBuffer
from services.buffer.config import BufferConfig
from services.buffer.service import registration
from services.client import connect
from services.config import ServerConfig
from services.server import create_server


def put_request(*samples: common_pb2.Sample) -> buffer_pb2.PutRequest:
    return buffer_pb2.PutRequest(samples=samples)


@contextlib.asynccontextmanager
async def running_buffer(tmp_path, server_config: ServerConfig | None = None, **settings):
    buffer = ReplayBuffer.open(BufferConfig(data_dir=str(tmp_path / "buffer"), **settings))
    await buffer.start()
    server, port = await create_server("127.0.0.1:0", [registration(buffer, server_config)], server_config)
    await server.start()
    channel = connect(f"127.0.0.1:{port}")
    try:
        yield buffer_pb2_grpc.BufferStub(channel), buffer
    finally:
        await channel.close()
        await server.stop(None)
        await buffer.close()


async def pull(stub, timeout: float = 5, **request) -> list[buffer_pb2.Batch]:
    request.setdefault("max_batches", 1)
    return [batch async for batch in stub.Pull(buffer_pb2.PullRequest(**request), timeout=timeout)]


async def expect_status(code: grpc.StatusCode, call, match: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details()
    return err.value.details()


async def test_put_pull_ack_roundtrip_with_whole_groups(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        group_a = [make_sample(f"a{i}", group="a", size=4) for i in range(4)]
        group_b = [make_sample(f"b{i}", group="b", size=4) for i in range(4)]

        async def requests():
            yield put_request(*group_a[:3], *group_b[:1])
            yield put_request(*group_b[1:], group_a[3])

        reply = await stub.PutStream(requests(), timeout=10)
        assert (reply.accepted, reply.duplicates) == (8, 0)
        assert (await stub.Put(put_request(group_a[0]), timeout=5)).duplicates == 1

        (first,) = await pull(stub, batch_size=4, consumer="t")
        assert [s.sample_id for s in first.samples] == ["b0", "b1", "b2", "b3"]  # b completed first
        assert first.samples[0] == group_b[0]  # stored bytes come back unchanged
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.pending, stats.leased, stats.accepted, stats.duplicates) == (4, 4, 8, 1)

        ack = await stub.Ack(buffer_pb2.AckRequest(lease_id=first.lease_id, trainer_version=7), timeout=5)
        assert ack.acked == 4
        await expect_status(grpc.StatusCode.NOT_FOUND, stub.Ack(buffer_pb2.AckRequest(lease_id=first.lease_id)),
                            "not open")
        (second,) = await pull(stub, batch_size=4)
        assert [s.sample_id for s in second.samples] == ["a0", "a1", "a2", "a3"] and second.trainer_version == 7
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.pending, stats.leased, stats.acked, stats.trainer_version) == (0, 4, 4, 7)


async def test_bad_requests_get_clear_statuses_and_the_server_keeps_serving(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        bad = make_sample("x")
        bad.loss_mask.CopyFrom(encode_array(np.ones(3, dtype=np.uint8), "uint8"))
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_request(bad)), "loss_mask")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_request(make_sample(""))), "sample_id")
        conflict = put_request(make_sample("g0", group="g", size=2), make_sample("g1", group="g", size=3))
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(conflict), "group_size")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, pull(stub, batch_size=0), "batch_size")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, pull(stub, batch_size=1, policy=9), "policy")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, pull(stub, batch_size=1, trainer_version=-1),
                            "trainer_version")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, pull(stub, batch_size=1, lease_timeout_s=-1),
                            "lease_timeout_s")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Ack(buffer_pb2.AckRequest()), "lease_id")
        await expect_status(grpc.StatusCode.NOT_FOUND, stub.Ack(buffer_pb2.AckRequest(lease_id="nope")))
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                            stub.SetVersion(buffer_pb2.SetVersionRequest(version=-2)), "version")
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert stats.accepted == 0  # nothing of a refused request was stored
        assert (await stub.Put(put_request(make_sample("ok")), timeout=5)).accepted == 1


async def test_full_buffer_rejects_with_resource_exhausted(tmp_path):
    async with running_buffer(tmp_path, capacity=3) as (stub, _):
        await stub.Put(put_request(*(make_sample(f"s{i}") for i in range(3))), timeout=5)
        await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Put(put_request(make_sample("s3"))),
                            "buffer full")
        assert (await stub.Put(put_request(make_sample("s0")), timeout=5)).duplicates == 1  # retries stay safe
        (batch,) = await pull(stub, batch_size=2)
        await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=5)
        assert (await stub.Put(put_request(make_sample("s3")), timeout=5)).accepted == 1


async def test_full_buffer_blocks_puts_and_streams_until_room_frees(tmp_path):
    async with running_buffer(tmp_path, capacity=2, backpressure="block", block_timeout_s=20) as (stub, _):
        await stub.Put(put_request(make_sample("s0"), make_sample("s1")), timeout=5)

        async def stream():
            for i in range(2, 6):
                yield put_request(make_sample(f"s{i}"))

        put_call = asyncio.ensure_future(stub.PutStream(stream(), timeout=20))
        await asyncio.sleep(0.3)
        assert not put_call.done(), "the stream is held at capacity"
        consumed = []
        while len(consumed) < 6:
            (batch,) = await pull(stub, batch_size=1)
            consumed += [s.sample_id for s in batch.samples]
            await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=5)
        assert (await put_call).accepted == 4
        assert consumed == [f"s{i}" for i in range(6)]


async def test_block_gives_up_after_block_timeout(tmp_path):
    async with running_buffer(tmp_path, capacity=1, backpressure="block", block_timeout_s=0.3) as (stub, _):
        await stub.Put(put_request(make_sample("s0")), timeout=5)
        await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Put(put_request(make_sample("s1")), timeout=5))


async def test_unacked_lease_is_delivered_again(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        await stub.Put(put_request(make_sample("s0"), make_sample("s1")), timeout=5)
        (first,) = await pull(stub, batch_size=2, lease_timeout_s=0.2)
        (again,) = await pull(stub, batch_size=2)  # waits for the expiry
        assert [s.sample_id for s in again.samples] == [s.sample_id for s in first.samples]
        await expect_status(grpc.StatusCode.NOT_FOUND, stub.Ack(buffer_pb2.AckRequest(lease_id=first.lease_id)))
        await stub.Ack(buffer_pb2.AckRequest(lease_id=again.lease_id), timeout=5)
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.redelivered, stats.acked, stats.pending, stats.leased) == (2, 2, 0, 0)


async def test_staleness_and_failed_samples_are_dropped_and_counted(tmp_path):
    async with running_buffer(tmp_path, max_staleness=1) as (stub, _):
        await stub.Put(put_request(
            make_sample("v0", version=0), make_sample("v2", version=2), make_sample("v3", version=3),
            make_sample("err", version=3, status=SampleStatus.FAILED),
        ), timeout=5)
        assert (await stub.SetVersion(buffer_pb2.SetVersionRequest(version=2), timeout=5)).dropped == 1
        (batch,) = await pull(stub, batch_size=1)
        assert batch.samples[0].sample_id == "v2"
        await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id, trainer_version=5), timeout=5)
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert dict(stats.dropped) == {"stale": 2, "failed": 1}
        assert (stats.pending, stats.max_staleness, stats.trainer_version) == (0, 1, 5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pull(stub, batch_size=1, timeout=0.5)  # nothing left: a failed sample is never handed out
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_uniform_replay_hands_each_sample_out_max_reuse_times(tmp_path):
    async with running_buffer(tmp_path, seed=3) as (stub, _):
        await stub.Put(put_request(*(make_sample(f"s{i}") for i in range(6))), timeout=5)
        counts: dict[str, int] = {}
        call = stub.Pull(buffer_pb2.PullRequest(batch_size=2, policy=buffer_pb2.POLICY_UNIFORM, max_reuse=2,
                                                max_batches=6), timeout=10)
        async for batch in call:
            for sample in batch.samples:
                counts[sample.sample_id] = counts.get(sample.sample_id, 0) + 1
            await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=5)
        assert counts == {f"s{i}": 2 for i in range(6)}
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.acked, stats.pending) == (6, 0)


@pytest.mark.parametrize("version", [0, 5, -1, 2**63 - 1])
def test_batches_are_encoded_from_stored_bytes_exactly_as_protobuf_would(version):
    from services.buffer.results import LeasedBatch
    from services.buffer.wire import encode_batch

    samples = [make_sample("a", tokens=3), make_sample("ü" * 70, tokens=200)]
    batch = LeasedBatch("lease-1", [s.SerializeToString() for s in samples], version)
    decoded = buffer_pb2.Batch.FromString(encode_batch(batch))
    assert decoded == buffer_pb2.Batch(lease_id="lease-1", samples=samples, trainer_version=version)


def test_put_requests_are_split_into_the_producers_sample_bytes():
    from services.buffer.wire import PutPayload, Undecodable, decode_put

    samples = [make_sample("a", tokens=3), make_sample("b" * 300, tokens=100)]
    wire = buffer_pb2.PutRequest(samples=samples).SerializeToString()
    unknown_fields = b"\x10\x96\x01" + b"\x1d\x00\x00\x80\x3f" + b"\x22\x02hi"  # varint, fixed32, bytes
    payload = decode_put(wire + unknown_fields)
    assert isinstance(payload, PutPayload)
    assert [bytes(view) for view in payload.samples] == [s.SerializeToString() for s in samples]
    assert decode_put(b"").samples == []
    for broken in (wire[:-1], b"\x0a\xff", b"\x00", b"\x0b", b"\x0a" + b"\xff" * 11):
        assert isinstance(decode_put(broken), Undecodable), broken


async def test_a_batch_over_the_message_limit_is_refused_and_handed_back(tmp_path):
    limit = ServerConfig(max_message_bytes=64 << 10)
    async with running_buffer(tmp_path, server_config=limit) as (stub, _):
        for i in range(0, 6, 2):  # 17 KB samples: a Put of two fits, a batch of six does not
            await stub.Put(put_request(make_sample(f"s{i}", tokens=1000), make_sample(f"s{i + 1}", tokens=1000)),
                           timeout=5)
        await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, pull(stub, batch_size=6), "pull smaller batches")
        (batch,) = await pull(stub, batch_size=2)  # the refused batch's samples are pending again at once
        assert [s.sample_id for s in batch.samples] == ["s0", "s1"]
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.pending, stats.leased, stats.redelivered) == (4, 2, 0)


async def test_a_pull_stream_leases_at_most_max_unacked_batches_ahead(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        await stub.Put(put_request(*(make_sample(f"s{i}") for i in range(4))), timeout=5)
        call = stub.Pull(buffer_pb2.PullRequest(batch_size=1, max_unacked=2), timeout=10)
        first, _second = await call.read(), await call.read()
        third = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.3)
        assert not third.done(), "a third batch waits for an ack"
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.leased, stats.pending) == (2, 2)
        await stub.Ack(buffer_pb2.AckRequest(lease_id=first.lease_id), timeout=5)
        assert (await asyncio.wait_for(third, 5)).samples[0].sample_id == "s2"
        call.cancel()


async def test_metrics_count_what_the_buffer_does(tmp_path):
    from prometheus_client import REGISTRY

    def value(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = {name: value(name) for name in ("relayrl_buffer_accepted_samples_total",
                                             "relayrl_buffer_acked_samples_total", "relayrl_buffer_fsync_seconds_count")}
    failed_before = value("relayrl_buffer_dropped_samples_total", reason="failed")
    async with running_buffer(tmp_path, fsync="batch") as (stub, _):
        await stub.Put(put_request(make_sample("a"), make_sample("b"), make_sample("x", status=SampleStatus.FAILED)),
                       timeout=5)
        (batch,) = await pull(stub, batch_size=1)
        assert value("relayrl_buffer_samples", state="leased") == 1
        assert value("relayrl_buffer_samples", state="pending") == 1
        await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=5)
    assert value("relayrl_buffer_accepted_samples_total") - before["relayrl_buffer_accepted_samples_total"] == 3
    assert value("relayrl_buffer_acked_samples_total") - before["relayrl_buffer_acked_samples_total"] == 1
    assert value("relayrl_buffer_dropped_samples_total", reason="failed") - failed_before == 1
    assert value("relayrl_buffer_fsync_seconds_count") > before["relayrl_buffer_fsync_seconds_count"]


async def extend(stub, *lease_ids: str, **fields) -> buffer_pb2.ExtendLeaseResponse:
    return await stub.ExtendLease(buffer_pb2.ExtendLeaseRequest(lease_ids=lease_ids, **fields), timeout=5)


async def test_extend_lease_keeps_a_batch_past_its_timeout_and_marks_it_consumed(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        await stub.Put(put_request(*(make_sample(f"s{i}") for i in range(4))), timeout=5)
        (batch,) = await pull(stub, batch_size=2, lease_timeout_s=0.4)
        for _ in range(4):  # a heartbeat: 0.8 s in all, twice the lease timeout
            await asyncio.sleep(0.2)
            reply = await extend(stub, batch.lease_id, "unknown", lease_timeout_s=0.4)
            assert (reply.extended, list(reply.missing)) == (1, ["unknown"])
        reply = await extend(stub, batch.lease_id, lease_timeout_s=0.4, consumed=True, trainer_version=3)
        assert (reply.extended, list(reply.missing)) == (1, [])
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.leased, stats.consumed, stats.pending, stats.trainer_version, stats.redelivered) == (2, 2, 2, 3, 0)
        assert (await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=5)).acked == 2
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.leased, stats.consumed, stats.acked) == (0, 0, 2)


async def test_an_expired_consumed_lease_is_delivered_again_and_its_ack_is_not_found(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        await stub.Put(put_request(make_sample("s0"), make_sample("s1")), timeout=5)
        (first,) = await pull(stub, batch_size=2, lease_timeout_s=5)
        await extend(stub, first.lease_id, lease_timeout_s=0.2, consumed=True)  # no heartbeat follows
        (again,) = await pull(stub, batch_size=2)
        assert [s.sample_id for s in again.samples] == ["s0", "s1"]
        await expect_status(grpc.StatusCode.NOT_FOUND, stub.Ack(buffer_pb2.AckRequest(lease_id=first.lease_id)),
                            "delivered again")
        assert list((await extend(stub, first.lease_id, again.lease_id)).missing) == [first.lease_id]
        stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
        assert (stats.redelivered, stats.leased, stats.consumed) == (2, 2, 0)


async def test_consumed_leases_do_not_hold_back_a_pull_streams_prefetch(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        await stub.Put(put_request(*(make_sample(f"s{i}") for i in range(3))), timeout=5)
        call = stub.Pull(buffer_pb2.PullRequest(batch_size=1, max_unacked=1), timeout=10)
        first = await call.read()
        second = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.3)
        assert not second.done(), "the stream waits while its batch is being trained on"
        await extend(stub, first.lease_id, consumed=True)  # trained; held until the checkpoint
        assert (await asyncio.wait_for(second, 5)).samples[0].sample_id == "s1"
        call.cancel()


async def test_extend_lease_refuses_bad_requests(tmp_path):
    async with running_buffer(tmp_path) as (stub, _):
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, extend(stub, "x", lease_timeout_s=-1), "lease_timeout_s")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, extend(stub, "x", lease_timeout_s=float("nan")),
                            "lease_timeout_s")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, extend(stub, "x", trainer_version=-1), "trainer_version")
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, extend(stub, ""), "lease_ids")
        assert (await extend(stub)).extended == 0
