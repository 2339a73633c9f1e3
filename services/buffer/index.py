"""The replay buffer's in-memory index of held samples: their states, groups, trained marks and staleness.

Pure logic over sample ids: no I/O, no clock (callers pass `now`), no protobuf. Payloads live in
the log; an entry carries an opaque `ref` to find its payload. Leases over the index are store.py's.

Life of a sample here:

    add() -> STAGED   written, waiting for its fsync: counts against capacity, never handed out
    publish() -> PENDING
    (LEASED while a lease holds it: store.py)
    drop_stale()        pending samples too old for the trainer's version are removed

A sample whose lease was marked consumed is *trained* (Entry.trained) until acked, until a lease holding it
expires, or until another consumer pulls (void_marks: a new trainer process replaced the one that trained it,
whose training since its last checkpoint is lost): pending again (the buffer restarted and lost its leases), it is exempt from staleness drops and
from incomplete-group drops, and its group goes out first (the trainer acks it without training again).

A group is complete once `group_size` members arrived (failed ones included), or once it is
closed: expire_groups() closes a group still incomplete `timeout` after its first member arrived,
dropping the members it holds that no trainer has (see `expire_groups`). A group is forgotten when
complete and empty; `on_group_done` hears of it, so the caller can refuse its late members.

A group is the unit of hand-out: a GRPO group (`group_size` > 1 samples sharing a group id) or a
sample of its own. A group is complete once `group_size` samples of it have arrived (dropped ones
count: they will never come), and whole-group pulls take only complete groups with every
surviving member pending.
"""

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from services.buffer.entries import Entry, EntryState, Group, GroupKey, GroupSizeConflict, NewSample
from services.buffer.ready import GroupQueue


class SampleIndex:
    """Index of held samples. `capacity` bounds staged + pending + leased samples; the caller
    checks `free` before `add` (it decides between rejecting and waiting)."""

    def __init__(
        self, capacity: int, max_staleness: int | None, on_group_done: Callable[[str], None] | None = None
    ):
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.trainer_version = -1
        self._entries: dict[str, Entry] = {}
        self._groups: dict[GroupKey, Group] = {}
        self._whole_ready = GroupQueue()
        self._partial_ready = GroupQueue()
        self._stale_heap: list[tuple[int, int, str]] = []
        self._heap_tiebreak = itertools.count()
        self._counts = dict.fromkeys(EntryState, 0)
        self._incomplete: OrderedDict[GroupKey, float] = OrderedDict()  # group -> first arrival, oldest first
        self.on_group_done = on_group_done  # called with the id of every multi-member group forgotten

    # --- counts -------------------------------------------------------------------------------

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property

    def free(self) -> int:
        return self.capacity - len(self._entries)

    def count(self, state: EntryState) -> int:
        return self._counts[state]

    def state_of(self, sample_id: str) -> EntryState | None:
        entry = self._entries.get(sample_id)
        return entry.state if entry else None

    # --- arrivals -----------------------------------------------------------------------------

    def check_groups(self, samples: Iterable[NewSample]) -> None:
        """Raise GroupSizeConflict if a sample's group size disagrees with its group's."""
        sizes: dict[GroupKey, int] = {}
        for sample in samples:
            if sample.group_size <= 1:
                continue
            key = sample.group_key
            known = self._groups[key].size if key in self._groups else sizes.get(key)
            if known is not None and known != sample.group_size:
                raise GroupSizeConflict(
                    f"group_size: sample {sample.sample_id!r} says group {sample.group_id!r} holds "
                    f"{sample.group_size} samples, earlier samples said {known}"
                )
            sizes[key] = sample.group_size

    def awaited(self, group_id: str) -> int | None:
        """Members group `group_id` still waits for (0: complete), None if no such group is held."""
        group = self._groups.get(("group", group_id))
        return None if group is None else (0 if group.complete else group.size - group.arrived)

    def add(self, samples: Iterable[NewSample], now: float) -> None:
        """Index new samples as STAGED (the caller deduplicated them, checked `free` and refused
        late members of complete groups, see `awaited`)."""
        for sample in samples:
            self._hold(sample, self._arrive(sample, now))

    def add_moved(self, sample: NewSample, uses: int) -> None:
        """Recovery: a sample copied forward from a segment compacted away. Its arrival was counted
        before the checkpoint recovery started from: its group is that checkpoint's open group (if
        restored), or a complete one."""
        key = sample.group_key
        if key not in self._groups:
            size = max(sample.group_size, 1)
            self._groups[key] = Group(key, size, arrived=size)
        self._hold(sample, self._groups[key]).uses = uses

    def _hold(self, sample: NewSample, group: Group) -> Entry:
        if sample.sample_id in self._entries:
            raise ValueError(f"sample {sample.sample_id!r} is already held")
        entry = Entry(sample.sample_id, sample.group_key, sample.oldest_version, sample.ref)
        group.members[sample.sample_id] = entry
        self._entries[sample.sample_id] = entry
        self._counts[EntryState.STAGED] += 1
        return entry

    def count_arrival(self, sample: NewSample, now: float) -> None:
        """A sample that arrived but is never held (failed): it still completes its group."""
        self._refresh(self._arrive(sample, now))

    def _arrive(self, sample: NewSample, now: float) -> Group:
        key = sample.group_key
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(key, max(sample.group_size, 1))
            if group.size > 1:
                self._incomplete[key] = now
        group.arrived += 1
        if group.complete:
            self._incomplete.pop(key, None)
        return group

    def relocate(self, sample_id: str, ref: Any, uses: int | None = None) -> None:
        """The sample's payload now lies at `ref` (compaction copied it forward); recovery also
        restores its use count from the copy."""
        entry = self._entries[sample_id]
        entry.ref = ref
        if uses is not None:
            entry.uses = uses

    def uses_of(self, sample_id: str) -> int:
        return self._entries[sample_id].uses

    def publish(self, sample_ids: Iterable[str]) -> None:
        """STAGED -> PENDING: durable now, may be handed out."""
        for sample_id in sample_ids:
            entry = self._entries.get(sample_id)
            if entry is not None and entry.state is EntryState.STAGED:
                self._make_pending(entry)

    def mark_used(self, sample_ids: Iterable[str]) -> None:
        """Recovery: these samples were handed out and returned once more."""
        for sample_id in sample_ids:
            entry = self._entries.get(sample_id)
            if entry is not None:
                entry.uses += 1

    def mark_trained(self, sample_ids: Iterable[str]) -> list[str]:
        """These held samples were trained on (a consumed lease, or recovery); returns those held. A pending one's
        group goes to the front of the line."""
        marked = []
        for sample_id in sample_ids:
            entry = self._entries.get(sample_id)
            if entry is None:
                continue
            entry.trained = True
            marked.append(sample_id)
        for key in reversed(list(dict.fromkeys(self._entries[i].group_key for i in marked))):
            if self._groups[key].pending:
                self._refresh(self._groups[key], front=True)
        return marked

    def void_marks(self) -> list[str]:
        """Unmark every trained sample (their trainer was replaced); returns their ids. Pending ones may go stale."""
        voided = []
        for entry in self._entries.values():
            if entry.trained:
                entry.trained = False
                voided.append(entry)
        for entry in voided:
            if entry.state is EntryState.PENDING and self.max_staleness is not None and entry.oldest_version >= 0:
                heapq.heappush(self._stale_heap, (entry.oldest_version, next(self._heap_tiebreak), entry.sample_id))
        return [entry.sample_id for entry in voided]

    def discard(self, sample_ids: Iterable[str]) -> list[str]:
        """Remove held, unleased samples (recovery replaying acks and drops); returns those removed."""
        removed = []
        for sample_id in sample_ids:
            entry = self._entries.get(sample_id)
            if entry is not None and entry.state is not EntryState.LEASED:
                self._remove(entry)
                removed.append(sample_id)
        return removed

    # --- staleness ----------------------------------------------------------------------------

    def set_version(self, version: int) -> list[str]:
        """The trainer is at `version` now; returns the ids of pending samples dropped as stale. Versions are
        job-wide and only grow: a report of an older one (an ack sent before the pull that said a newer one, arriving
        after it) changes nothing, or a pull waiting for a batch would take samples its trainer has outgrown."""
        self.trainer_version = max(self.trainer_version, version)
        return self.drop_stale()

    def is_stale(self, oldest_version: int) -> bool:
        return (
            self.max_staleness is not None
            and oldest_version >= 0
            and self.trainer_version - oldest_version > self.max_staleness
        )

    def drop_stale(self) -> list[str]:
        """Remove pending samples with `trainer_version - oldest_version > max_staleness`."""
        if self.max_staleness is None:
            return []
        oldest_allowed = self.trainer_version - self.max_staleness
        dropped = []
        while self._stale_heap and self._stale_heap[0][0] < oldest_allowed:
            _, _, sample_id = heapq.heappop(self._stale_heap)
            entry = self._entries.get(sample_id)
            # A leased sample is in a trainer's hands; it is pushed again if it comes back. A trained one was
            # trained within bounds already (it is pushed again if its mark is voided).
            if entry is not None and entry.state is EntryState.PENDING and not entry.trained:
                self._remove(entry)
                dropped.append(sample_id)
        return dropped

    def expire_groups(self, now: float, timeout: float) -> list[str]:
        """Close groups still incomplete `timeout` after their first member arrived; returns the
        ids of the members dropped: those no trainer holds. A member under a lease (partial-group
        pulls) stays with its lease and, closed, its group goes out as it is if it comes back; so does a trained one."""
        dropped = []
        while self._incomplete:
            key, since = next(iter(self._incomplete.items()))
            if since + timeout > now:
                break
            del self._incomplete[key]
            group = self._groups[key]
            group.closed = True
            for entry in [e for e in group.members.values() if e.state is not EntryState.LEASED and not e.trained]:
                self._remove(entry)
                dropped.append(entry.sample_id)
            if self._groups.get(key) is group:  # still holds leased members, or held none
                self._refresh(group)
        return dropped

    def incomplete_groups(self) -> list[str]:
        return [key[1] for key in self._incomplete]

    def close_groups(self, group_ids: Iterable[str]) -> None:
        """Recovery: these groups were closed or done before; wait for no more members."""
        for group_id in group_ids:
            group = self._groups.get(("group", group_id))
            if group is not None:
                group.closed = True
                self._incomplete.pop(group.key, None)
                self._refresh(group)

    # --- checkpoints --------------------------------------------------------------------------

    def open_groups(self) -> dict[str, tuple[int, int]]:
        """Incomplete groups: group id -> (size, arrived)."""
        return {
            group.key[1]: (group.size, group.arrived)
            for group in self._groups.values()
            if group.key[0] == "group" and not group.complete
        }

    def restore_groups(self, open_groups: dict[str, tuple[int, int]], now: float) -> None:
        """Recovery: groups some of whose samples arrived in segments compacted away (their
        incomplete-group timeout starts again at `now`)."""
        for group_id, (size, arrived) in open_groups.items():
            key = ("group", group_id)
            self._groups[key] = Group(key, size, arrived)
            self._incomplete[key] = now

    # --- internals ----------------------------------------------------------------------------

    def _set_state(self, entry: Entry, state: EntryState) -> None:
        group = self._groups[entry.group_key]
        group.pending += (state is EntryState.PENDING) - (entry.state is EntryState.PENDING)
        self._counts[entry.state] -= 1
        self._counts[state] += 1
        entry.state = state

    def _make_pending(self, entry: Entry, front: bool = False) -> None:
        self._set_state(entry, EntryState.PENDING)
        if self.max_staleness is not None and entry.oldest_version >= 0 and not entry.trained:
            heapq.heappush(self._stale_heap, (entry.oldest_version, next(self._heap_tiebreak), entry.sample_id))
        self._refresh(self._groups[entry.group_key], front)

    def _remove(self, entry: Entry) -> None:
        group = self._groups[entry.group_key]
        if entry.state is EntryState.PENDING:
            group.pending -= 1
        self._counts[entry.state] -= 1
        del group.members[entry.sample_id]
        del self._entries[entry.sample_id]
        self._refresh(group)

    def _refresh(self, group: Group, front: bool = False) -> None:
        """Put the group in (or take it out of) the ready queues; forget it once it is done."""
        key = group.key
        if group.pending and group.complete and group.pending == len(group.members):
            self._whole_ready.add(key, front)
        else:
            self._whole_ready.discard(key)
        if group.pending:
            self._partial_ready.add(key, front)
        else:
            self._partial_ready.discard(key)
        if not group.members and group.complete:
            del self._groups[key]
            self._incomplete.pop(key, None)
            if key[0] == "group" and self.on_group_done is not None:
                self.on_group_done(key[1])
