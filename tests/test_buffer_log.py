"""The durable log and compaction: torn tails, corruption, roll-over, fsync policies, and compaction keeping the
disk bounded by live data (and every held sample, retired id and consumed mark through it)."""

import asyncio
import os
import random

import pytest
from buffer_kit import Clock, config, make_sample, opened, opened_at, pending_ids, segment_files

from protos import common_pb2
from protos.sample import SampleStatus
from services.buffer.buffer import ReplayBuffer
from services.buffer.entries import EntryState, PullSpec
from services.buffer.log import LogCorruption, RecordKind, SegmentLog
from services.buffer.records import Checkpoint

CHECKPOINT = Checkpoint().encode()


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


# --- compaction -------------------------------------------------------------------------------------


def dir_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".seg")


async def put_and_ack(buffer: ReplayBuffer, sample_ids: list[str], tokens: int = 40, version: int = 0) -> None:
    for sample_id in sample_ids:
        await buffer.put([make_sample(sample_id, tokens=tokens, version=version)])
        batch = await buffer.lease_batch(PullSpec(batch_size=1))
        await buffer.ack(batch.lease_id)


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
