"""Crash test: a real buffer process, SIGKILLed at random moments while producers put and a trainer
pulls and acks, restarted on the same data_dir and port each time.

Afterwards every sample a producer saw acknowledged is acked by the trainer exactly once (or still
pending), and no sample is delivered again after the trainer's ack of it was confirmed.
"""

import asyncio
import os
import random
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

from deploy.local.service_process import start_service
from protos import buffer_pb2, buffer_pb2_grpc
from protos.sample import Sample

PRODUCERS = 4
SAMPLES_PER_PRODUCER = 2_500
GROUP = 4  # GRPO-style groups: Pull hands out whole groups
GROUPS_PER_PUT = 2
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
# Fast reconnects: the buffer comes back on the same port within a second or two.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 300)]


@dataclass
class Ledger:
    """What the clients saw; the invariants are checked against it."""

    put_acked: set[str] = field(default_factory=set)  # Put answered OK for these
    confirmed: set[str] = field(default_factory=set)  # trainer's Ack answered OK
    ambiguous: set[str] = field(default_factory=set)  # Ack sent, no answer (the buffer died)
    delivered_after_ambiguous: set[str] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    draining: bool = False

    def durably_acked(self) -> set[str]:
        """Confirmed acks, and lost-in-flight acks whose samples never came back (so they were written)."""
        return self.confirmed | (self.ambiguous - self.delivered_after_ambiguous)


def group_request(producer: int, groups: list[int]) -> buffer_pb2.PutRequest:
    samples = []
    for g in groups:
        for i in range(GROUP):
            tokens = 16
            samples.append(Sample(
                sample_id=f"p{producer}-g{g}-{i}", prompt_id=f"p{producer}-g{g}", group_size=GROUP,
                prompt_ids=np.arange(8, dtype=np.int32), response_ids=np.arange(tokens, dtype=np.int32),
                loss_mask=np.ones(tokens, dtype=np.uint8), rollout_logprobs=np.zeros(tokens, dtype=np.float32),
                weight_versions=np.zeros(tokens, dtype=np.int64), reward=float(i),
            ).to_proto())
    return buffer_pb2.PutRequest(samples=samples)


async def produce(address: str, producer: int, ledger: Ledger) -> None:
    groups = list(range(SAMPLES_PER_PRODUCER // GROUP))
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        for start in range(0, len(groups), GROUPS_PER_PUT):
            request = group_request(producer, groups[start : start + GROUPS_PER_PUT])
            while True:  # a producer retries with the same sample ids: duplicates are idempotent
                try:
                    await stub.Put(request, timeout=5)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in RETRYABLE, f"Put failed: {exc.code()}: {exc.details()}"
                    await asyncio.sleep(0.05)
            ledger.put_acked.update(s.sample_id for s in request.samples)


async def consume(address: str, ledger: Ledger) -> None:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        while True:
            batch_size = GROUP if ledger.draining else 4 * GROUP
            request = buffer_pb2.PullRequest(batch_size=batch_size, lease_timeout_s=2.0, consumer="crash-test")
            try:
                async for batch in stub.Pull(request, timeout=2):
                    await take(stub, batch, ledger)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE | {grpc.StatusCode.CANCELLED}:
                    raise
                await asyncio.sleep(0.05)


async def take(stub, batch: buffer_pb2.Batch, ledger: Ledger) -> None:
    ids = [s.sample_id for s in batch.samples]
    for sample_id in ids:
        if sample_id in ledger.confirmed:
            ledger.violations.append(f"{sample_id} delivered again after its ack was confirmed")
        if sample_id in ledger.ambiguous:
            ledger.delivered_after_ambiguous.add(sample_id)
    try:
        await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=5)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # lease lost with the crash or expired: redelivered
            return
        assert exc.code() in RETRYABLE | {grpc.StatusCode.CANCELLED}, f"Ack: {exc.code()}: {exc.details()}"
        ledger.ambiguous.update(ids)
        return
    for sample_id in ids:
        if sample_id in ledger.confirmed:
            ledger.violations.append(f"{sample_id} acked twice")
        ledger.confirmed.add(sample_id)


def tear_tail(data_dir, rng: random.Random) -> None:
    """Leave a torn write at the end of the log, as a crash in the middle of one would."""
    segment = max(p for p in os.listdir(data_dir) if p.endswith(".seg"))
    with open(os.path.join(data_dir, segment), "ab") as f:
        f.write(rng.randbytes(37))


async def kill_at_random_moments(start, buffer, ledger: Ledger, rng: random.Random, kills: int, data_dir):
    total = PRODUCERS * SAMPLES_PER_PRODUCER
    # A kill point is a moment in the flow of data: after so many puts + acks (of 2 * total).
    thresholds = sorted(rng.sample(range(total // 10, 2 * total - total // 10), kills))
    for n, threshold in enumerate(thresholds):
        while len(ledger.put_acked) + len(ledger.confirmed) < threshold:
            await asyncio.sleep(0.005)
        await asyncio.sleep(rng.uniform(0, 0.02))
        buffer.kill()
        if n == 1:
            tear_tail(data_dir, rng)
        buffer = await asyncio.to_thread(start)
    return buffer


@pytest.mark.slow  # 25-40 s on an idle 2-core machine, up to ~95 s measured under heavy load
async def test_sigkill_at_random_moments_loses_nothing_acknowledged(tmp_path, free_port):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    address = f"127.0.0.1:{free_port}"
    data_dir = tmp_path / "buffer-data"
    overrides = {"data_dir": str(data_dir), "server.address": address, "fsync": "batch",
                 "capacity": 3_000, "lease_timeout_s": 2.0, "segment_bytes": 1 << 20}

    def start():
        return start_service("buffer", overrides, log_dir=tmp_path / "logs", timeout=60)

    buffer = start()
    ledger = Ledger()
    try:
        consumer = asyncio.ensure_future(consume(address, ledger))
        producers = asyncio.gather(*(produce(address, p, ledger) for p in range(PRODUCERS)))
        killer = asyncio.ensure_future(kill_at_random_moments(start, buffer, ledger, rng, 4, data_dir))
        await asyncio.wait_for(producers, 120)
        ledger.draining = True  # whole-group batches of one group: the last groups need no company
        buffer = await asyncio.wait_for(killer, 120)
        async with asyncio.timeout(120):
            while not ledger.put_acked <= ledger.durably_acked():
                assert not consumer.done(), consumer.exception()
                await asyncio.sleep(0.05)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)

        async with grpc.aio.insecure_channel(address) as channel:
            stats = await buffer_pb2_grpc.BufferStub(channel).Stats(buffer_pb2.StatsRequest(), timeout=5)
    finally:
        log_tail = buffer.log_tail(60)
        buffer.stop(timeout=10)

    context = f"seed {seed}; buffer log:\n{log_tail}"
    assert ledger.violations == [], context
    assert len(ledger.put_acked) == PRODUCERS * SAMPLES_PER_PRODUCER, context
    assert ledger.put_acked <= ledger.durably_acked(), "acknowledged samples were lost; " + context
    # The buffer's own durable count agrees: each sample acked exactly once, nothing left over.
    assert (stats.accepted, stats.acked, stats.pending, stats.leased) == (
        PRODUCERS * SAMPLES_PER_PRODUCER, len(ledger.durably_acked()), 0, 0), context
    full_log = buffer.log_path.read_text()
    assert full_log.count("recovered ") == 5 and "cut a torn tail" in full_log, context  # 4 kills, 1 torn write
    print(f"seed {seed}: {len(ledger.ambiguous)} acks lost in flight, {stats.redelivered} redelivered since the "
          f"last restart; recoveries:\n" + "\n".join(line for line in full_log.splitlines() if "recovered " in line))


async def test_a_consumed_lease_lost_with_the_buffer_is_redelivered_and_acked_ids_stay_refused(tmp_path, free_port):
    """Through a real buffer process, SIGKILLed: what the trainer's exactly-once protocol relies on."""
    address = f"127.0.0.1:{free_port}"
    overrides = {"data_dir": str(tmp_path / "data"), "server.address": address, "segment_bytes": 4096}
    buffer = start_service("buffer", overrides, log_dir=tmp_path / "logs", timeout=60)
    try:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            await stub.Put(group_request(0, [0, 1]), timeout=5)
            pull = buffer_pb2.PullRequest(batch_size=GROUP, max_batches=1, lease_timeout_s=1)
            (trained,) = [batch async for batch in stub.Pull(pull, timeout=5)]
            (consumed,) = [batch async for batch in stub.Pull(pull, timeout=5)]
            await stub.Ack(buffer_pb2.AckRequest(lease_id=trained.lease_id), timeout=5)
            heartbeat = buffer_pb2.ExtendLeaseRequest(lease_ids=[consumed.lease_id], lease_timeout_s=1)
            for _ in range(4):  # past the lease timeout: the heartbeat keeps the lease open
                await asyncio.sleep(0.3)
                assert (await stub.ExtendLease(heartbeat, timeout=5)).extended == 1
            extension = buffer_pb2.ExtendLeaseRequest(lease_ids=[consumed.lease_id], consumed=True, trainer_version=4)
            assert (await stub.ExtendLease(extension, timeout=5)).extended == 1
            stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
            assert (stats.leased, stats.consumed, stats.trainer_version) == (GROUP, GROUP, 4)
            for start in range(2, 40, GROUPS_PER_PUT):  # roll the log over: compaction copies and deletes
                await stub.Put(group_request(1, list(range(start, start + GROUPS_PER_PUT))), timeout=5)

            await asyncio.to_thread(buffer.restart, 60)
            assert (await stub.ExtendLease(extension, timeout=10)).missing == [consumed.lease_id]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Ack(buffer_pb2.AckRequest(lease_id=consumed.lease_id), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "delivered again" in err.value.details()
            (again,) = [batch async for batch in stub.Pull(pull, timeout=5)]
            assert [s.sample_id for s in again.samples] == [s.sample_id for s in consumed.samples]
            reply = await stub.Put(group_request(0, [0, 1]), timeout=5)  # the acked group and the held one
            assert (reply.accepted, reply.duplicates) == (0, 2 * GROUP)
            stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
            assert (stats.acked, stats.trainer_version, stats.consumed) == (GROUP, 4, 0)
    finally:
        log_tail = buffer.log_tail(30)
        buffer.stop(timeout=10)
    assert "compacted log segments" in log_tail or "compacted log segments" in buffer.log_path.read_text(), log_tail


async def test_samples_trained_under_a_consumed_lease_survive_a_sigkill_and_are_never_stale(tmp_path, free_port):
    """A trainer trained a batch and marked its lease consumed; the buffer is SIGKILLed and restarted; the trainer's
    version moves far ahead: the batch comes back (not dropped as stale) for the trainer to ack."""
    address = f"127.0.0.1:{free_port}"
    overrides = {"data_dir": str(tmp_path / "data"), "server.address": address, "max_staleness": 1}
    buffer = start_service("buffer", overrides, log_dir=tmp_path / "logs", timeout=60)
    try:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            await stub.Put(group_request(0, [0, 1]), timeout=5)  # weight version 0
            pull = buffer_pb2.PullRequest(batch_size=GROUP, max_batches=1)
            (consumed,) = [batch async for batch in stub.Pull(pull, timeout=5)]
            extension = buffer_pb2.ExtendLeaseRequest(lease_ids=[consumed.lease_id], consumed=True, trainer_version=1)
            assert (await stub.ExtendLease(extension, timeout=5)).extended == 1

            await asyncio.to_thread(buffer.restart, 60)
            await stub.SetVersion(buffer_pb2.SetVersionRequest(version=100), timeout=10)
            stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
            assert dict(stats.dropped) == {"stale": GROUP} and stats.pending == GROUP  # the other group went stale
            (again,) = [batch async for batch in stub.Pull(pull, timeout=5)]
            assert [s.sample_id for s in again.samples] == [s.sample_id for s in consumed.samples]
            assert (await stub.Ack(buffer_pb2.AckRequest(lease_id=again.lease_id), timeout=5)).acked == GROUP
            stats = await stub.Stats(buffer_pb2.StatsRequest(), timeout=5)
            assert (stats.acked, stats.pending, dict(stats.dropped)) == (GROUP, 0, {"stale": GROUP})
    finally:
        buffer.stop(timeout=10)
