"""The replay buffer's in-memory index: groups, sampling policies, leases and staleness.

Pure logic over sample ids: no I/O, no clock (callers pass `now`), no protobuf. Payloads live in
the log; an entry carries an opaque `ref` to find its payload.

Life of a sample:

    add() -> STAGED   written, waiting for its fsync: counts against capacity, never handed out
    publish() -> PENDING
    lease() -> LEASED   in a trainer's hands under a lease (extend() moves its deadline and may
                        mark it consumed: trained on, held until the trainer's checkpoint acks it)
    ack() -> gone       (uniform replay: PENDING again until its reuse limit)
    expire()            an unacked lease's samples go back to PENDING, first in line (consumed or not;
                        their trained mark is void: the trainer that trained them may have lost it)

A sample whose lease was marked consumed is *trained* (Entry.trained) until acked, until a lease holding it
expires, or until another consumer pulls (void_marks: a new trainer process replaced the one that trained it,
whose training since its last checkpoint is lost): pending again (the buffer restarted and lost its leases), it is exempt from staleness drops and
from incomplete-group drops, and its group goes out first (the trainer acks it without training again).

A group is complete once `group_size` members arrived (failed ones included), or once it is
closed: expire_groups() closes a group still incomplete `timeout` after its first member arrived,
dropping the members it holds that no trainer has (see `expire_groups`). A group is forgotten when
complete and empty; `on_group_done` hears of it, so the caller can refuse its late members.
    drop_stale()        pending samples too old for the trainer's version are removed

A group is the unit of hand-out: a GRPO group (`group_size` > 1 samples sharing a group id) or a
sample of its own. A group is complete once `group_size` samples of it have arrived (dropped ones
count: they will never come), and whole-group pulls take only complete groups with every
surviving member pending.
"""

import enum
import heapq
import itertools
import random
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

GroupKey = tuple[str, str]  # ("group", group_id) or ("sample", sample_id) for a sample of its own


class EntryState(enum.Enum):
    STAGED = "staged"
    PENDING = "pending"
    LEASED = "leased"


class Policy(enum.Enum):
    FIFO = "fifo"  # oldest first, each sample once
    UNIFORM = "uniform"  # uniform random replay, each sample up to `max_reuse` times


class GroupSizeConflict(ValueError):
    """Samples of one group disagree on the group's size."""


class LeaseNotFound(KeyError):
    """No open lease has this id: it was acked already, it expired, or it never existed."""


@dataclass(frozen=True, slots=True)
class NewSample:
    """What the index needs to know about a sample; the payload stays where `ref` points."""

    sample_id: str
    group_id: str
    group_size: int
    oldest_version: int  # oldest policy version of a trained-on token (-1: none, never stale)
    ref: Any = None

    @property
    def group_key(self) -> GroupKey:
        return ("group", self.group_id) if self.group_size > 1 else ("sample", self.sample_id)


@dataclass(slots=True, eq=False)
class Entry:
    sample_id: str
    group_key: GroupKey
    oldest_version: int
    ref: Any
    state: EntryState = EntryState.STAGED
    uses: int = 0  # times handed out and acked without being used up (uniform replay)
    trained: bool = False  # in a lease marked consumed (see the module docstring)


@dataclass(eq=False)
class Group:
    key: GroupKey
    size: int  # samples the group holds when complete (1 for a sample of its own)
    arrived: int = 0  # samples that ever arrived, including dropped and acked ones
    pending: int = 0  # members in PENDING
    members: dict[str, Entry] = field(default_factory=dict)
    closed: bool = False  # given up on the members still missing (expire_groups)

    @property
    def complete(self) -> bool:
        return self.closed or self.arrived >= self.size


@dataclass(frozen=True)
class PullSpec:
    """What a consumer asks for."""

    batch_size: int  # samples per batch
    whole_groups: bool = True  # only complete groups, never split
    policy: Policy = Policy.FIFO
    max_reuse: int = 1  # hand-outs per sample before it is used up (FIFO: 1)
    lease_timeout_s: float = 60.0
    consumer: str = ""  # who pulls (a trainer process: a new one replaces the one before)


@dataclass(eq=False)
class Lease:
    lease_id: str
    entries: list[Entry]  # groups contiguous
    deadline: float
    max_reuse: int
    consumed: bool = False  # trained on; held only until the trainer acks it after its checkpoint
    consumer: str = ""


class GroupQueue:
    """Group keys in hand-out order, with uniform random picks in O(batch)."""

    def __init__(self) -> None:
        self._order: OrderedDict[GroupKey, None] = OrderedDict()
        self._keys: list[GroupKey] = []
        self._index: dict[GroupKey, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: GroupKey) -> bool:
        return key in self._index

    def add(self, key: GroupKey, front: bool = False) -> None:
        if key not in self._index:
            self._index[key] = len(self._keys)
            self._keys.append(key)
            self._order[key] = None
        if front:
            self._order.move_to_end(key, last=False)

    def discard(self, key: GroupKey) -> None:
        index = self._index.pop(key, None)
        if index is None:
            return
        last = self._keys.pop()
        if index < len(self._keys):
            self._keys[index] = last
            self._index[last] = index
        del self._order[key]

    def oldest_first(self) -> Iterator[GroupKey]:
        return iter(self._order)

    def random(self, rng: random.Random, count: int) -> list[GroupKey]:
        return rng.sample(self._keys, min(count, len(self._keys)))


class SampleStore:
    """Index of held samples. `capacity` bounds staged + pending + leased samples; the caller
    checks `free` before `add` (it decides between rejecting and waiting)."""

    def __init__(
        self,
        capacity: int,
        max_staleness: int | None,
        seed: int | None = None,
        on_group_done: Callable[[str], None] | None = None,
    ):
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.trainer_version = -1
        self._entries: dict[str, Entry] = {}
        self._groups: dict[GroupKey, Group] = {}
        self._whole_ready = GroupQueue()
        self._partial_ready = GroupQueue()
        self._leases: dict[str, Lease] = {}
        self._stale_heap: list[tuple[int, int, str]] = []
        self._heap_tiebreak = itertools.count()
        self._rng = random.Random(seed)
        self._counts = dict.fromkeys(EntryState, 0)
        self._consumed = 0  # samples in consumed leases
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

    @property
    def consumed(self) -> int:
        """Samples in leases marked consumed (a subset of LEASED)."""
        return self._consumed

    @property
    def open_leases(self) -> int:
        return len(self._leases)

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

    def lease_consumer(self, lease_id: str) -> str:
        return self._leases[lease_id].consumer

    def lease_sample_ids(self, lease_id: str) -> list[str]:
        return [entry.sample_id for entry in self._leases[lease_id].entries]

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
        """The trainer is at `version` now; returns the ids of pending samples dropped as stale."""
        self.trainer_version = version
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

    # --- hand-out -----------------------------------------------------------------------------

    def lease(self, spec: PullSpec, now: float) -> Lease | None:
        """Lease a batch per `spec`, or None while too few samples are ready to fill one.

        A batch is full at `batch_size` samples. With whole groups it may also end early when the
        next group does not fit, and a group larger than the batch goes out alone.
        """
        queue = self._whole_ready if spec.whole_groups else self._partial_ready
        if spec.policy is Policy.FIFO:
            keys: Iterable[GroupKey] = queue.oldest_first()
        else:
            keys = queue.random(self._rng, spec.batch_size)
        chosen: list[Entry] = []
        for key in keys:
            group = self._groups[key]
            room = spec.batch_size - len(chosen)
            if spec.whole_groups:
                if group.pending > room:
                    if not chosen:
                        chosen.extend(group.members.values())
                    break
                chosen.extend(group.members.values())
            else:
                pending = (e for e in group.members.values() if e.state is EntryState.PENDING)
                chosen.extend(itertools.islice(pending, room))
            if len(chosen) >= spec.batch_size:
                break
        else:
            return None
        for entry in chosen:
            self._set_state(entry, EntryState.LEASED)
        for key in {entry.group_key for entry in chosen}:
            self._refresh(self._groups[key])
        max_reuse = 1 if spec.policy is Policy.FIFO else spec.max_reuse
        lease = Lease(uuid.uuid4().hex, chosen, now + spec.lease_timeout_s, max_reuse, consumer=spec.consumer)
        self._leases[lease.lease_id] = lease
        return lease

    def ack(self, lease_id: str) -> tuple[list[str], list[str]]:
        """Close a lease: returns (ids used up and removed for good, ids pending again for reuse)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseNotFound(lease_id)
        self._consumed -= len(lease.entries) if lease.consumed else 0
        done, reused = [], []
        for entry in lease.entries:
            entry.uses += 1
            if entry.uses >= lease.max_reuse:
                self._remove(entry)
                done.append(entry.sample_id)
            else:
                entry.trained = False  # to be trained again
                self._make_pending(entry)
                reused.append(entry.sample_id)
        return done, reused

    def expire(self, now: float) -> list[Lease]:
        """Close leases past their deadline; their samples are pending again, first in line, and no longer
        marked trained (the trainer stopped holding them: what it trained may be lost with it)."""
        expired = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in expired:
            for entry in lease.entries:
                entry.trained = False
            self.release(lease.lease_id)
        return expired

    def release(self, lease_id: str) -> None:
        """Close a lease without using its samples: they are pending again, first in line."""
        lease = self._leases.pop(lease_id)
        self._consumed -= len(lease.entries) if lease.consumed else 0
        for entry in reversed(lease.entries):  # moved to the front one by one: keeps their order
            self._make_pending(entry, front=True)

    def extend(self, lease_ids: Iterable[str], deadline: float, consumed: bool) -> list[str]:
        """Move the deadline of open leases to `deadline` (and mark them consumed if asked; a
        consumed lease stays consumed); returns the ids of those not open."""
        missing = []
        for lease_id in dict.fromkeys(lease_ids):
            lease = self._leases.get(lease_id)
            if lease is None:
                missing.append(lease_id)
                continue
            lease.deadline = deadline
            if consumed and not lease.consumed:
                lease.consumed = True
                self._consumed += len(lease.entries)
        return missing

    def awaits_training(self, lease_id: str) -> bool:
        """Open and not yet marked consumed."""
        lease = self._leases.get(lease_id)
        return lease is not None and not lease.consumed

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)

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
