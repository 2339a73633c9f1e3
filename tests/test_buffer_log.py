"""The durable log and recovery: torn tails, corruption, roll-over, compaction, fsync policies."""

import asyncio
import os
import random

import pytest
from buffer_samples import sample_proto

from protos import common_pb2
from protos.sample import SampleStatus
from services.buffer.buffer import ReplayBuffer
from services.buffer.config import BufferConfig
from services.buffer.log import LogCorruption, RecordKind, SegmentLog
from services.buffer.records import Checkpoint
from services.buffer.store import PullSpec

CHECKPOINT = Checkpoint().encode()


def make_sample(sample_id: str, **fields) -> bytes:
    """A serialized sample, as the buffer stores it."""
    return sample_proto(sample_id, **fields).SerializeToString()


def segment_files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.suffix == ".seg")


# --- the log alone ------------------------------------------------------------------------------


def test_append_replay_and_read_back(tmp_path):
    log = SegmentLog.open(tmp_path, 1 << 20, CHECKPOINT)
    payloads = [os.urandom(n) for n in (0, 1, 100, 5000)]
    locations = log.append([(RecordKind.PUT, p) for p in payloads])
    assert [log.read(loc) for loc in locations] == payloads
    log.close()
    reopened = SegmentLog.open(tmp_path, 1 << 20, CHECKPOINT)
    records = list(reopened.replay())
    assert [r.kind for r in records] == [RecordKind.CHECKPOINT] + [RecordKind.PUT] * 4
    assert [bytes(r.payload) for r in records[1:]] == payloads
    assert [r.location for r in records[1:]] == locations and reopened.truncated_bytes == 0


def test_torn_tail_is_cut_at_every_offset(tmp_path):
    """A crash can stop the last write anywhere: recovery keeps the whole records before it."""
    log = SegmentLog.open(tmp_path / "src", 1 << 20, CHECKPOINT)
    log.append([(RecordKind.PUT, b"a" * 50), (RecordKind.PUT, b"b" * 50)])
    log.close()
    full = (tmp_path / "src" / segment_files(tmp_path / "src")[0]).read_bytes()
    last_start = len(full) - (8 + 1 + 50)
    for cut in range(last_start, len(full)):
        directory = tmp_path / f"cut{cut}"
        directory.mkdir()
        (directory / "0000000001.seg").write_bytes(full[:cut])
        torn = SegmentLog.open(directory, 1 << 20, CHECKPOINT)
        assert [bytes(r.payload) for r in torn.replay()][1:] == [b"a" * 50]
        assert torn.truncated_bytes == cut - last_start
        torn.append([(RecordKind.PUT, b"c")])  # appends continue right after the cut
        torn.close()
        assert [bytes(r.payload) for r in SegmentLog.open(directory, 1 << 20, CHECKPOINT).replay()][1:] == [
            b"a" * 50, b"c"]


def test_garbage_and_zeros_at_the_tail_are_cut(tmp_path):
    rng = random.Random(0)
    for trial, tail in enumerate([b"\0" * 4096, bytes(rng.randrange(256) for _ in range(300)), b"\xff" * 12]):
        directory = tmp_path / str(trial)
        log = SegmentLog.open(directory, 1 << 20, CHECKPOINT)
        log.append([(RecordKind.ACK, b"x")])
        log.close()
        with open(directory / "0000000001.seg", "ab") as f:
            f.write(tail)
        reopened = SegmentLog.open(directory, 1 << 20, CHECKPOINT)
        assert [r.kind for r in reopened.replay()] == [RecordKind.CHECKPOINT, RecordKind.ACK]
        assert reopened.truncated_bytes == len(tail)


def test_damage_inside_a_sealed_segment_is_refused_not_guessed(tmp_path):
    log = SegmentLog.open(tmp_path, 4096, CHECKPOINT)
    for _ in range(4):
        log.append([(RecordKind.PUT, b"p" * 1000)])
        if log.needs_roll(1009):
            log.roll(CHECKPOINT)
    log.close()
    first = tmp_path / segment_files(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(LogCorruption, match="damaged"):
        list(SegmentLog.open(tmp_path, 4096, CHECKPOINT).replay())


def test_crash_while_rolling_over_falls_back_to_the_previous_segment(tmp_path):
    log = SegmentLog.open(tmp_path, 1 << 20, CHECKPOINT)
    log.append([(RecordKind.PUT, b"kept")])
    log.close()
    (tmp_path / "0000000002.seg").write_bytes(b"\x05\x00")  # the new segment's checkpoint, torn
    reopened = SegmentLog.open(tmp_path, 1 << 20, CHECKPOINT)
    assert segment_files(tmp_path) == ["0000000001.seg"] and reopened.active_segment == 1
    assert [bytes(r.payload) for r in reopened.replay()][1:] == [b"kept"]


# --- recovery of the buffer ---------------------------------------------------------------------


def config(path, **overrides) -> BufferConfig:
    return BufferConfig(data_dir=str(path), **{"fsync": "never", **overrides})


async def opened(cfg: BufferConfig) -> ReplayBuffer:
    buffer = ReplayBuffer.open(cfg)
    await buffer.start()
    return buffer


async def test_recovery_restores_unacked_and_forgets_acked(tmp_path):
    cfg = config(tmp_path, max_staleness=3)
    buffer = await opened(cfg)
    await buffer.put([make_sample(f"s{i}") for i in range(6)])
    await buffer.put([make_sample("bad", status=SampleStatus.FAILED)])
    acked = await buffer.lease_batch(PullSpec(batch_size=2))
    await buffer.ack(acked.lease_id, trainer_version=1)
    await buffer.lease_batch(PullSpec(batch_size=2))  # leased, never acked: the crash loses the lease
    del buffer  # no close(): what a killed process leaves behind

    recovered = await opened(cfg)
    stats = recovered.stats()
    assert (stats.pending, stats.leased, stats.acked, stats.accepted) == (4, 0, 2, 7)
    assert stats.dropped == {"failed": 1} and stats.trainer_version == 1
    acked_ids = {common_pb2.Sample.FromString(p).sample_id for p in acked.payloads}
    assert not acked_ids & set(recovered.store._entries)
    result = await recovered.put([make_sample("s0"), make_sample("s5"), make_sample("s9")])
    assert (result.accepted, result.duplicates) == (1, 2)  # acked and pending ids are both known
    await recovered.close()


async def test_recovery_drops_what_went_stale_and_records_it(tmp_path):
    cfg = config(tmp_path, max_staleness=1)
    buffer = await opened(cfg)
    await buffer.put([make_sample("v0", version=0), make_sample("v5", version=5)])
    assert await buffer.set_version(3) == 1
    await buffer.close()
    recovered = await opened(cfg)
    assert recovered.stats().dropped == {"stale": 1} and recovered.stats().pending == 1
    await recovered.close()


async def test_torn_put_at_the_tail_never_crashes_recovery(tmp_path):
    cfg = config(tmp_path)
    buffer = await opened(cfg)
    await buffer.put([make_sample("whole")])
    await buffer.put([make_sample("torn", tokens=500)])
    await buffer.close()
    segment = tmp_path / segment_files(tmp_path)[-1]
    os.truncate(segment, segment.stat().st_size - 700)
    recovered = await opened(cfg)
    assert set(recovered.store._entries) == {"whole"}
    assert recovered.log.truncated_bytes > 0
    await recovered.close()


async def test_compaction_deletes_resolved_segments_and_keeps_counts_and_groups(tmp_path):
    cfg = config(tmp_path, segment_bytes=4096)
    buffer = await opened(cfg)
    await buffer.put([make_sample("g-0", group="g", size=2)])  # half a group, in the first segment
    for i in range(40):
        await buffer.put([make_sample(f"s{i}", tokens=40)])
        batch = await buffer.lease_batch(PullSpec(batch_size=1))
        await buffer.ack(batch.lease_id)
    await buffer.put([make_sample("g-1", group="g", size=2)])
    group_lease = await buffer.lease_batch(PullSpec(batch_size=2))
    await buffer.ack(group_lease.lease_id)  # now the first segment holds nothing live
    for i in range(40, 50):
        await buffer.put([make_sample(f"s{i}", tokens=40)])
    await buffer.put([make_sample("h-0", group="h", size=2)])
    for i in range(50, 80):
        await buffer.put([make_sample(f"s{i}", tokens=40)])
    segments_before = buffer.log.segments()
    await buffer.close()
    assert segments_before[0] > 1, "old segments were compacted away"

    recovered = await opened(cfg)
    stats = recovered.stats()
    assert (stats.accepted, stats.acked, stats.pending) == (83, 42, 41)
    await recovered.put([make_sample("h-1", group="h", size=2)])  # h's first half is in the checkpoint
    batch = await recovered.lease_batch(PullSpec(batch_size=2, whole_groups=True))
    assert {common_pb2.Sample.FromString(p).sample_id for p in batch.payloads} == {"s40", "s41"}
    await recovered.close()


@pytest.mark.parametrize("policy", ["always", "batch", "never"])
async def test_fsync_policies(tmp_path, policy):
    buffer = await opened(config(tmp_path, fsync=policy, fsync_window_ms=5))
    await asyncio.gather(*(buffer.put([make_sample(f"s{i}")]) for i in range(20)))
    fsyncs = buffer.durability.fsyncs
    if policy == "batch":
        assert 1 <= fsyncs <= 5, "concurrent Puts share a group-commit fsync"
    elif policy == "always":
        assert fsyncs >= 1
    else:
        assert fsyncs == 0
    assert buffer.durability.durable == buffer.log.appended or policy == "never"
    assert buffer.stats().pending == 20
    await buffer.close()
