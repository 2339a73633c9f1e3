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
from services.buffer.entries import EntryState, PullSpec
from services.buffer.log import LogCorruption, RecordKind, SegmentLog
from services.buffer.records import Checkpoint

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


class Clock:
    """The buffer's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def opened_at(cfg: BufferConfig, clock: Clock) -> ReplayBuffer:
    buffer = ReplayBuffer.open(cfg, clock=clock)
    await buffer.start()
    return buffer


def dir_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".seg")


def pending_ids(buffer: ReplayBuffer) -> set[str]:
    return set(buffer.store._entries)


async def put_and_ack(buffer: ReplayBuffer, sample_ids: list[str], tokens: int = 40, version: int = 0) -> None:
    for sample_id in sample_ids:
        await buffer.put([make_sample(sample_id, tokens=tokens, version=version)])
        batch = await buffer.lease_batch(PullSpec(batch_size=1))
        await buffer.ack(batch.lease_id)


async def test_disk_stays_bounded_by_live_data_while_one_sample_stays_pending(tmp_path):
    segment = 8192
    cfg = config(tmp_path, segment_bytes=segment)
    buffer = await opened_at(cfg, Clock())
    await buffer.put([make_sample("h-0", group="h", size=2)])  # half a group: never handed out
    sample_bytes = len(make_sample("s0000", tokens=40))
    largest = 0
    for i in range(0, 2000, 50):
        await put_and_ack(buffer, [f"s{j:04d}" for j in range(i, i + 50)])
        largest = max(largest, dir_bytes(tmp_path))
    stored = 2001
    # Live data: the pending sample and 8 bytes per id ever stored (retired ids stay refused).
    live = len(make_sample("h-0", group="h", size=2)) + 8 * stored
    bound = live / cfg.compact_live_ratio + 4 * segment + sample_bytes
    assert largest <= bound, f"log grew to {largest} bytes for {live} live ({stored * sample_bytes} put in all)"
    assert stored * sample_bytes > 4 * bound  # without compaction past the pending sample it would not fit
    del buffer  # a crash: no close

    recovered = await opened_at(cfg, Clock())
    assert pending_ids(recovered) == {"h-0"}
    stats = recovered.stats()
    assert (stats.accepted, stats.acked, stats.pending) == (2001, 2000, 1)
    assert (await recovered.put([make_sample("s0007"), make_sample("h-0", group="h", size=2)])).duplicates == 2
    await recovered.put([make_sample("h-1", group="h", size=2)])
    batch = await recovered.lease_batch(PullSpec(batch_size=2))
    assert {common_pb2.Sample.FromString(p).sample_id for p in batch.payloads} == {"h-0", "h-1"}
    await recovered.close()


async def test_a_crash_in_the_middle_of_compaction_keeps_every_sample_once(tmp_path):
    cfg = config(tmp_path, segment_bytes=8192)
    keep = make_sample("k-0", group="k", size=2, tokens=40)  # half a group: stays pending
    buffer = await opened_at(cfg, Clock())
    await buffer.put([keep])
    await put_and_ack(buffer, [f"s{i:03d}" for i in range(60)])
    first = buffer.log.segments()[0]
    assert first > 1, "compaction copied k-0 forward and deleted its segment"
    await buffer.close()
    # As if the process died after the copies' fsync and before the delete: the original is back.
    original = await opened_at(config(tmp_path / "orig"), Clock())
    await original.put([keep])
    await original.close()
    (tmp_path / "orig" / "0000000001.seg").rename(tmp_path / f"{first - 1:010d}.seg")
    recovered = await opened_at(cfg, Clock())
    assert pending_ids(recovered) == {"k-0"} and recovered.stats().pending == 1
    assert recovered.store.open_groups() == {"k": (2, 1)}  # the copy is no second arrival
    await recovered.put([make_sample("k-1", group="k", size=2)])
    batch = await recovered.lease_batch(PullSpec(batch_size=2))
    assert [common_pb2.Sample.FromString(p).sample_id for p in batch.payloads] == ["k-0", "k-1"]
    assert batch.payloads[0] == keep
    await recovered.close()


async def test_acked_and_dropped_ids_stay_refused_after_compaction_and_restart(tmp_path):
    cfg = config(tmp_path, segment_bytes=4096, max_staleness=0)
    buffer = await opened_at(cfg, Clock())
    await put_and_ack(buffer, ["x"])
    await buffer.put([make_sample("bad", status=SampleStatus.FAILED), make_sample("old", version=0)])
    await buffer.set_version(1)  # "old" is dropped as stale
    await put_and_ack(buffer, [f"s{i:03d}" for i in range(40)], version=1)
    assert buffer.log.segments()[0] > 1, "the segments holding x, bad and old were compacted away"
    await buffer.close()

    recovered = await opened_at(cfg, Clock())
    result = await recovered.put([make_sample(i, version=5) for i in ("x", "bad", "old", "s003")])
    assert (result.accepted, result.duplicates) == (0, 4)
    assert recovered.stats().pending == 0 and pending_ids(recovered) == set()
    assert (await recovered.put([make_sample("fresh", version=5)])).accepted == 1
    await recovered.close()


async def test_incomplete_groups_expire_durably_and_late_members_are_dropped(tmp_path):
    clock = Clock()
    cfg = config(tmp_path, incomplete_group_timeout_s=600)
    buffer = await opened_at(cfg, clock)
    await buffer.put([make_sample("g-0", group="g", size=4), make_sample("g-1", group="g", size=4)])
    await buffer.put([make_sample("a-0", group="a", size=2), make_sample("a-1", group="a", size=2)])
    batch = await buffer.lease_batch(PullSpec(batch_size=2))
    await buffer.ack(batch.lease_id)  # group a was handed out and acked
    clock.now += 599
    assert buffer.stats().dropped == {} and buffer.stats().pending == 2
    clock.now += 1
    stats = buffer.stats()
    assert stats.dropped == {"incomplete_group": 2} and stats.pending == 0
    # Members arriving after their group was closed, or done: dropped at once, no new group opens.
    result = await buffer.put([make_sample("g-2", group="g", size=4), make_sample("a-2", group="a", size=2)])
    assert (result.accepted, result.duplicates) == (2, 0)
    assert buffer.stats().dropped == {"incomplete_group": 2, "late_member": 2}
    assert pending_ids(buffer) == set() and buffer.store.open_groups() == {}
    del buffer  # a crash

    recovered = await opened_at(cfg, Clock())
    assert pending_ids(recovered) == set() and recovered.stats().dropped == {"incomplete_group": 2, "late_member": 2}
    await recovered.put([make_sample("g-3", group="g", size=4), make_sample("a-3", group="a", size=2),
                         make_sample("n-0", group="n", size=2)])
    assert pending_ids(recovered) == {"n-0"} and recovered.stats().dropped["late_member"] == 4
    await recovered.close()


async def test_a_member_beyond_its_group_size_is_dropped_as_late(tmp_path):
    buffer = await opened_at(config(tmp_path), Clock())
    await buffer.put([make_sample(f"g-{i}", group="g", size=2) for i in range(3)])
    assert buffer.stats().dropped == {"late_member": 1}
    batch = await buffer.lease_batch(PullSpec(batch_size=2))
    assert [common_pb2.Sample.FromString(p).sample_id for p in batch.payloads] == ["g-0", "g-1"]
    assert buffer.stats().pending == 0
    await buffer.close()


@pytest.mark.parametrize("seed", range(3))
async def test_random_puts_acks_compactions_and_crashes_keep_exactly_the_held_samples(tmp_path, seed):
    rng = random.Random(seed)
    cfg = config(tmp_path, segment_bytes=4096, compact_live_ratio=rng.choice([0.3, 0.5, 0.8]))
    buffer = await opened_at(cfg, Clock())
    held: set[str] = set()  # put, neither acked nor dropped
    retired: set[str] = set()
    leases: list[tuple[str, list[str]]] = []
    for step in range(400):
        roll = rng.random()
        if roll < 0.45:
            name = f"g{step}"
            size = rng.choice([1, 2, 2, 3])
            members = [f"{name}-{i}" for i in range(size)]
            failed = {m for m in members if rng.random() < 0.1}
            arrive = members if rng.random() < 0.9 else members[:-1]  # some groups never complete
            await buffer.put([make_sample(m, group=name if size > 1 else "", size=size, tokens=rng.choice([8, 60]),
                                          status=SampleStatus.FAILED if m in failed else SampleStatus.COMPLETED)
                              for m in arrive])
            held |= set(arrive) - failed
            retired |= set(arrive) & failed
        elif roll < 0.75 and buffer.store.count(EntryState.PENDING):
            lease = buffer.store.lease(PullSpec(batch_size=rng.choice([1, 2, 4])), buffer.clock())
            if lease is not None:
                leases.append((lease.lease_id, [e.sample_id for e in lease.entries]))
        elif roll < 0.95 and leases:
            lease_id, sample_ids = leases.pop(rng.randrange(len(leases)))
            await buffer.ack(lease_id)
            held -= set(sample_ids)
            retired |= set(sample_ids)
        else:
            if rng.random() < 0.5:
                await buffer.close()
            buffer = await opened_at(cfg, Clock())  # leases are lost with the process
            leases.clear()
            assert pending_ids(buffer) == held, f"step {step}"
        assert pending_ids(buffer) == held, f"step {step}"
    largest_live = len(held) * 1200 + 8 * (len(held) + len(retired))
    assert dir_bytes(tmp_path) <= largest_live / cfg.compact_live_ratio + 5 * cfg.segment_bytes
    result = await buffer.put([make_sample(sample_id) for sample_id in sorted(retired | held)])
    assert (result.accepted, result.duplicates) == (0, len(retired | held))
    await buffer.close()


# --- consumed leases across a restart -------------------------------------------------------------


def batch_ids(batch) -> list[str]:
    return [common_pb2.Sample.FromString(p).sample_id for p in batch.payloads]


async def test_consumed_samples_survive_a_crash_go_out_first_and_are_never_stale(tmp_path):
    """A trainer trained `b` and marked its lease consumed, then the buffer died: `b` is pending again, first in
    line, and a later version does not drop it as stale (the trainer acks it without training again)."""
    cfg = config(tmp_path, max_staleness=1)
    buffer = await opened_at(cfg, Clock())
    await buffer.put([make_sample("a", version=100), make_sample("b", version=0)])
    await buffer.lease_batch(PullSpec(batch_size=1))  # a: leased, never consumed
    consumed = await buffer.lease_batch(PullSpec(batch_size=1))
    assert batch_ids(consumed) == ["b"]
    assert await buffer.extend_leases([consumed.lease_id], 0, consumed=True, trainer_version=1) == (1, [])
    del buffer  # a crash: the leases are lost

    recovered = await opened_at(cfg, Clock())
    assert pending_ids(recovered) == {"a", "b"} and recovered.stats().pending == 2
    assert await recovered.set_version(100) == 0
    assert recovered.stats().dropped == {}
    again = await recovered.lease_batch(PullSpec(batch_size=1))
    assert batch_ids(again) == ["b"]  # ahead of the older a
    assert await recovered.ack(again.lease_id) == 1
    assert batch_ids(await recovered.lease_batch(PullSpec(batch_size=1))) == ["a"]
    stats = recovered.stats()
    assert (stats.acked, stats.dropped) == (1, {})
    await recovered.close()


async def test_consumed_marks_are_copied_forward_by_compaction(tmp_path):
    cfg = config(tmp_path, segment_bytes=4096, max_staleness=1)
    buffer = await opened_at(cfg, Clock())
    await buffer.put([make_sample(f"g-{i}", group="g", size=2, version=0) for i in range(2)])
    consumed = await buffer.lease_batch(PullSpec(batch_size=2))
    await buffer.extend_leases([consumed.lease_id], 0, consumed=True, trainer_version=1)
    await put_and_ack(buffer, [f"s{i:03d}" for i in range(40)], version=1)
    assert buffer.log.segments()[0] > 1, "the segment holding the CONSUMED record was compacted away"
    del buffer

    recovered = await opened_at(cfg, Clock())
    await recovered.set_version(50)
    assert recovered.stats().dropped == {} and pending_ids(recovered) == {"g-0", "g-1"}
    await recovered.close()
    reopened = await opened_at(cfg, Clock())  # the copies themselves survive another reopen
    assert reopened.stats().dropped == {} and pending_ids(reopened) == {"g-0", "g-1"}
    assert await reopened.ack((await reopened.lease_batch(PullSpec(batch_size=2))).lease_id) == 2
    await reopened.close()


async def test_an_expired_consumed_lease_voids_the_mark_durably(tmp_path):
    """A consumed lease that expires: its trainer stopped holding it (a crash before its checkpoint loses that
    training), so the samples are ordinary pending ones again, stale or not, also after a restart."""
    clock = Clock()
    cfg = config(tmp_path, max_staleness=1, lease_timeout_s=10)
    buffer = await opened_at(cfg, clock)
    await buffer.put([make_sample("a", version=0), make_sample("b", version=0)])
    first = await buffer.lease_batch(PullSpec(batch_size=1, lease_timeout_s=10))
    second = await buffer.lease_batch(PullSpec(batch_size=1, lease_timeout_s=10))
    await buffer.extend_leases([first.lease_id, second.lease_id], 0, consumed=True, trainer_version=1)
    clock.now += 5
    await buffer.extend_leases([second.lease_id], 0, consumed=False, trainer_version=None)  # heartbeat
    clock.now += 6
    assert buffer.stats().redelivered == 1  # the first lease expired
    del buffer

    recovered = await opened_at(cfg, Clock())
    assert await recovered.set_version(9) == 1  # a: dropped as stale; b stays marked
    assert recovered.stats().dropped == {"stale": 1} and pending_ids(recovered) == {"b"}
    await recovered.close()


async def test_a_lease_lost_in_a_restart_can_still_be_marked_consumed(tmp_path):
    """The buffer died while the trainer trained a batch: the trainer's ExtendLease(consumed) after the restart
    finds the lease gone but marks its samples trained, before its version makes them stale."""
    cfg = config(tmp_path, max_staleness=1)
    buffer = await opened_at(cfg, Clock())
    await buffer.put([make_sample("a", version=0), make_sample("b", version=0)])
    in_training = await buffer.lease_batch(PullSpec(batch_size=1))
    del buffer

    recovered = await opened_at(cfg, Clock())
    extended, missing = await recovered.extend_leases([in_training.lease_id], 0, consumed=True, trainer_version=5)
    assert (extended, missing) == (0, [in_training.lease_id])
    assert recovered.stats().dropped == {"stale": 1} and pending_ids(recovered) == set(batch_ids(in_training))
    await recovered.close()


async def test_a_new_consumer_voids_the_marks_of_the_trainer_it_replaced(tmp_path):
    """Trainer `a` trained x and died before its checkpoint; the buffer restarted meanwhile. x's mark survives
    the restart, but the first pull of the trainer that replaces `a` voids it: x is dropped as stale, never
    handed to `b` (whose history does not hold it and which may not train it that stale)."""
    cfg = config(tmp_path, max_staleness=1)
    buffer = await opened_at(cfg, Clock())
    await buffer.put([make_sample("x", version=0), make_sample("y", version=0), make_sample("z", version=9)])
    lease = await buffer.lease_batch(PullSpec(batch_size=1, consumer="a"))
    await buffer.extend_leases([lease.lease_id], 0, consumed=True, trainer_version=1)
    del buffer

    recovered = await opened_at(cfg, Clock())
    assert await recovered.set_version(10) == 1  # y; x is trained (by a, the last consumer)
    taken = await recovered.lease_batch(PullSpec(batch_size=1, consumer="b"))
    assert batch_ids(taken) == ["z"] and recovered.stats().dropped == {"stale": 2}
    del recovered

    again = await opened_at(cfg, Clock())
    assert pending_ids(again) == {"z"} and again.stats().dropped == {"stale": 2}
    lease = await again.lease_batch(PullSpec(batch_size=1, consumer="b"))
    await again.extend_leases([lease.lease_id], 0, consumed=True, trainer_version=11)
    await again.close()
    last = await opened_at(cfg, Clock())  # b is still the consumer: its mark holds
    assert await last.set_version(30) == 0 and pending_ids(last) == {"z"}
    await last.close()
