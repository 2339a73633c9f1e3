"""The buffer's in-memory index: groups, FIFO and uniform replay, leases, staleness."""

import pytest

from services.buffer.entries import (
    EntryState,
    GroupSizeConflict,
    LeaseNotFound,
    NewSample,
    Policy,
    PullSpec,
)
from services.buffer.store import SampleStore


def arrive(store: SampleStore, samples: list[NewSample], now: float = 0) -> None:
    store.check_groups(samples)
    store.add(samples, now)
    store.publish(s.sample_id for s in samples)


def group(name: str, size: int, version: int = 0, members: int | None = None) -> list[NewSample]:
    return [NewSample(f"{name}-{i}", name, size, version) for i in range(size if members is None else members)]


def ids(lease) -> list[str]:
    return [entry.sample_id for entry in lease.entries]


def test_whole_groups_only_when_complete_in_fifo_order():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 4, members=3))
    arrive(store, group("b", 4))
    spec = PullSpec(batch_size=4)
    assert ids(store.lease(spec, now=0)) == ["b-0", "b-1", "b-2", "b-3"]
    assert store.lease(spec, now=0) is None  # a is missing a member
    arrive(store, [NewSample("a-3", "a", 4, 0)])
    assert ids(store.lease(spec, now=0)) == ["a-0", "a-1", "a-2", "a-3"]


def test_batch_of_whole_groups_waits_to_fill_and_never_splits():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 2))
    spec = PullSpec(batch_size=4)
    assert store.lease(spec, now=0) is None  # half a batch: wait for more
    arrive(store, group("b", 2) + group("c", 2))
    assert ids(store.lease(spec, now=0)) == ["a-0", "a-1", "b-0", "b-1"]
    arrive(store, group("d", 3))  # c (2) + d (3) > 4: c goes out alone, d waits
    assert ids(store.lease(spec, now=0)) == ["c-0", "c-1"]
    big = SampleStore(capacity=100, max_staleness=None)
    arrive(big, group("e", 8))
    assert len(ids(big.lease(spec, now=0))) == 8  # a group larger than the batch goes out alone


def test_partial_groups_fill_batches_from_incomplete_groups():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 4, members=3) + group("b", 4, members=2))
    lease = store.lease(PullSpec(batch_size=4, whole_groups=False), now=0)
    assert ids(lease) == ["a-0", "a-1", "a-2", "b-0"]
    assert store.count(EntryState.PENDING) == 1


def test_singletons_and_group_size_conflicts():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, [NewSample("x", "p", 0, 0), NewSample("y", "p", 1, 0)])  # sizes 0/1: each its own group
    assert ids(store.lease(PullSpec(batch_size=1), now=0)) == ["x"]
    arrive(store, group("g", 4, members=1))
    with pytest.raises(GroupSizeConflict, match="group_size"):
        store.check_groups([NewSample("g-9", "g", 8, 0)])
    with pytest.raises(GroupSizeConflict):
        store.check_groups([NewSample("h-0", "h", 2, 0), NewSample("h-1", "h", 3, 0)])


def test_ack_removes_for_good_and_twice_is_not_found():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 2))
    lease = store.lease(PullSpec(batch_size=2), now=0)
    assert store.ack(lease.lease_id) == (["a-0", "a-1"], [])
    assert len(store) == 0 and store.lease(PullSpec(batch_size=2), now=0) is None
    with pytest.raises(LeaseNotFound):
        store.ack(lease.lease_id)


def test_expired_lease_is_delivered_again_first_and_its_ack_refused():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 2) + group("b", 2))
    first = store.lease(PullSpec(batch_size=2, lease_timeout_s=5), now=0)
    assert store.next_deadline() == 5
    assert store.expire(now=4.9) == []
    assert [lease.lease_id for lease in store.expire(now=5)] == [first.lease_id]
    again = store.lease(PullSpec(batch_size=2), now=6)
    assert ids(again) == ids(first)  # redelivered before b
    with pytest.raises(LeaseNotFound):
        store.ack(first.lease_id)
    assert store.ack(again.lease_id)[0] == ids(first)


def test_uniform_replay_reuses_each_sample_up_to_its_limit():
    store = SampleStore(capacity=100, max_staleness=None, seed=1)
    arrive(store, [NewSample(f"s{i}", f"p{i}", 1, 0) for i in range(10)])
    spec = PullSpec(batch_size=1, policy=Policy.UNIFORM, max_reuse=3)
    handed: dict[str, int] = {}
    while (lease := store.lease(spec, now=0)) is not None:
        for sample_id in ids(lease):
            handed[sample_id] = handed.get(sample_id, 0) + 1
        store.ack(lease.lease_id)
    assert handed == {f"s{i}": 3 for i in range(10)}
    assert len(store) == 0


def test_uniform_replay_picks_at_random():
    store = SampleStore(capacity=1000, max_staleness=None, seed=0)
    arrive(store, [NewSample(f"s{i:03d}", f"p{i}", 1, 0) for i in range(200)])
    lease = store.lease(PullSpec(batch_size=20, policy=Policy.UNIFORM, max_reuse=2), now=0)
    assert ids(lease) != [f"s{i:03d}" for i in range(20)]


def test_staleness_drops_pending_not_leased_and_checks_oldest_version():
    store = SampleStore(capacity=100, max_staleness=2)
    arrive(store, group("old", 2, version=1) + group("new", 2, version=5) + group("held", 2, version=1))
    arrive(store, [NewSample("unversioned", "u", 1, -1)])
    lease = store.lease(PullSpec(batch_size=2), now=0)  # "old" (FIFO)
    assert store.set_version(3) == []  # 3 - 1 = 2: still allowed
    assert sorted(store.set_version(4)) == ["held-0", "held-1"]  # leased "old" is not dropped
    assert store.ack(lease.lease_id)[0] == ["old-0", "old-1"]
    assert "unversioned" in store and "new-0" in store
    assert store.set_version(100) == ["new-0", "new-1"]
    assert "unversioned" in store  # no trained-on token, no version: never stale


def test_a_late_report_of_an_older_version_does_not_turn_the_staleness_bound_back():
    """CI (2026-12-07, tests/test_reward_replicas.py under load): the trainer's pull said version 131 and waited; the
    ack of its last step, sent with version 130 and delivered after the pull, set the buffer back to 130, and the
    waiting pull took a sample of version 129: "the buffer handed out a sample 2 versions old at trainer version 131"."""
    store = SampleStore(capacity=100, max_staleness=1)
    store.set_version(131)  # the pull's version
    assert store.set_version(130) == [] and store.trainer_version == 131  # the late ack's
    arrive(store, group("late", 2, version=129))
    store.drop_stale()
    assert store.lease(PullSpec(batch_size=2), now=0) is None


def test_expired_stale_samples_are_dropped_when_they_come_back():
    store = SampleStore(capacity=100, max_staleness=0)
    arrive(store, group("a", 2, version=0))
    store.set_version(0)
    store.lease(PullSpec(batch_size=2, lease_timeout_s=1), now=0)
    assert store.set_version(1) == []
    store.expire(now=2)
    assert sorted(store.drop_stale()) == ["a-0", "a-1"]


def test_a_dropped_member_still_completes_its_group():
    store = SampleStore(capacity=100, max_staleness=None)
    members = group("g", 3)
    arrive(store, members[:2])
    store.count_arrival(members[2], now=0)  # a failed sample: never held, but it arrived
    assert ids(store.lease(PullSpec(batch_size=2), now=0)) == ["g-0", "g-1"]


def test_capacity_counts_staged_pending_and_leased():
    store = SampleStore(capacity=5, max_staleness=None)
    arrive(store, group("a", 2))
    store.add([NewSample("staged", "s", 1, 0)], now=0)
    store.lease(PullSpec(batch_size=2), now=0)
    assert store.free == 2
    assert store.count(EntryState.STAGED) == 1 and store.count(EntryState.LEASED) == 2
    assert store.lease(PullSpec(batch_size=1), now=0) is None  # staged samples are not handed out


def test_open_groups_roundtrip_for_checkpoints():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 4, members=1) + group("b", 2))
    assert store.open_groups() == {"a": (4, 1)}
    restored = SampleStore(capacity=100, max_staleness=None)
    restored.restore_groups(store.open_groups(), now=0)
    arrive(restored, [NewSample(f"a-{i}", "a", 4, 0) for i in range(1, 4)])
    assert len(ids(restored.lease(PullSpec(batch_size=3), now=0))) == 3


def test_extend_moves_deadlines_and_marks_leases_consumed():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 2) + group("b", 2))
    first = store.lease(PullSpec(batch_size=2, lease_timeout_s=5), now=0)
    second = store.lease(PullSpec(batch_size=2, lease_timeout_s=5), now=0)
    assert store.extend([first.lease_id, "gone", first.lease_id], deadline=12, consumed=True) == ["gone"]
    assert store.consumed == 2 and store.count(EntryState.LEASED) == 4
    assert not store.awaits_training(first.lease_id) and store.awaits_training(second.lease_id)
    assert [lease.lease_id for lease in store.expire(now=6)] == [second.lease_id]  # first's deadline moved
    assert store.expire(now=11.9) == [] and store.consumed == 2
    store.extend([first.lease_id], deadline=20, consumed=False)  # a heartbeat keeps it consumed
    assert store.consumed == 2
    assert [lease.lease_id for lease in store.expire(now=20)] == [first.lease_id]  # consumed, still redelivered
    assert store.consumed == 0 and store.count(EntryState.PENDING) == 4
    again = store.lease(PullSpec(batch_size=2), now=21)
    assert ids(again) == ids(first)
    store.extend([again.lease_id], deadline=30, consumed=True)
    store.ack(again.lease_id)
    assert store.consumed == 0 and store.extend([again.lease_id], deadline=40, consumed=True) == [again.lease_id]


def test_incomplete_groups_close_after_the_timeout_and_drop_what_they_hold():
    done: list[str] = []
    store = SampleStore(capacity=100, max_staleness=None, on_group_done=done.append)
    arrive(store, group("a", 4, members=3), now=10)
    arrive(store, group("b", 2, members=1), now=20)
    arrive(store, group("c", 2), now=20)  # complete: never expires
    assert store.expire_groups(now=609.9, timeout=600) == []
    assert sorted(store.expire_groups(now=610, timeout=600)) == ["a-0", "a-1", "a-2"]
    assert done == ["a"] and store.awaited("a") is None and store.open_groups() == {"b": (2, 1)}
    assert store.expire_groups(now=620, timeout=600) == ["b-0"]
    assert len(store) == 2 and store.open_groups() == {} and done == ["a", "b"]


def test_a_closed_group_keeps_its_leased_members_and_hands_them_out_as_they_are():
    store = SampleStore(capacity=100, max_staleness=None)
    arrive(store, group("a", 4, members=2), now=0)
    partial = store.lease(PullSpec(batch_size=1, whole_groups=False, lease_timeout_s=5), now=0)
    assert store.expire_groups(now=600, timeout=600) == ["a-1"]  # a-0 is in a trainer's hands
    assert store.awaited("a") == 0  # closed: no member is awaited, a late one is refused by the caller
    store.expire(now=700)
    arrive(store, group("z", 3), now=700)
    # The closed group goes out as it is, first in line (its lease expired), with company to fill the batch.
    assert ids(store.lease(PullSpec(batch_size=4), now=700)) == ids(partial) + ["z-0", "z-1", "z-2"]


def test_a_group_with_a_failed_member_goes_out_as_a_short_group():
    store = SampleStore(capacity=100, max_staleness=None)
    members = group("g", 8)
    arrive(store, members[:3] + members[4:])
    store.count_arrival(members[3], now=0)  # FAILED at Put: dropped, but it arrived
    arrive(store, group("h", 8) + group("k", 8))
    spec = PullSpec(batch_size=8)
    assert ids(store.lease(spec, now=0)) == [m.sample_id for m in members if m.sample_id != "g-3"]  # 7 samples
    assert len(ids(store.lease(spec, now=0))) == 8
    wide = SampleStore(capacity=100, max_staleness=None)
    arrive(wide, members[:3] + members[4:])
    wide.count_arrival(members[3], now=0)
    arrive(wide, group("h", 8) + group("k", 8))
    assert len(ids(wide.lease(PullSpec(batch_size=16), now=0))) == 15  # g (7) + h (8): k does not fit


def test_a_group_whose_members_all_failed_completes_and_is_forgotten():
    done: list[str] = []
    store = SampleStore(capacity=100, max_staleness=None, on_group_done=done.append)
    for member in group("f", 4):
        store.count_arrival(member, now=0)
    assert done == ["f"] and store.awaited("f") is None and store.open_groups() == {}
    assert store.expire_groups(now=1e9, timeout=1) == []
