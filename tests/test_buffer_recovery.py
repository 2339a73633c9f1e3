"""Recovery of the buffer: what a restart keeps and what it drops (unacked and stale samples, torn puts,
incomplete groups and late members), and consumed leases across a restart."""

import os

from buffer_kit import Clock, config, make_sample, opened, opened_at, pending_ids, segment_files

from protos import common_pb2
from protos.sample import SampleStatus
from services.buffer.entries import PullSpec

# --- recovery of the buffer ---------------------------------------------------------------------


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
