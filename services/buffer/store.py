"""Leases over the replay buffer's index (index.py): hand-out by policy, ack, expiry, extension.

Life of a sample under a lease:

    PENDING (index.py)
    lease() -> LEASED   in a trainer's hands under a lease (extend() moves its deadline and may
                        mark it consumed: trained on, held until the trainer's checkpoint acks it)
    ack() -> gone       (uniform replay: PENDING again until its reuse limit)
    expire()            an unacked lease's samples go back to PENDING, first in line (consumed or not;
                        their trained mark is void: the trainer that trained them may have lost it)
"""

import itertools
import random
import uuid
from collections.abc import Callable, Iterable

from services.buffer.entries import Entry, EntryState, Group, GroupKey, Lease, LeaseNotFound, Policy, PullSpec
from services.buffer.index import SampleIndex


class SampleStore(SampleIndex):
    """The index with the leases that hand its samples out (FIFO or uniform replay)."""

    def __init__(
        self,
        capacity: int,
        max_staleness: int | None,
        seed: int | None = None,
        on_group_done: Callable[[str], None] | None = None,
        canonical_order: bool = False,
    ):
        super().__init__(capacity, max_staleness, on_group_done)
        self._leases: dict[str, Lease] = {}
        self._rng = random.Random(seed)
        self._consumed = 0  # samples in consumed leases
        self.canonical_order = canonical_order  # hand out by _canonical_key, not by arrival (deterministic runs)

    # --- leases -------------------------------------------------------------------------------

    @property

    def consumed(self) -> int:
        """Samples in leases marked consumed (a subset of LEASED)."""
        return self._consumed

    @property

    def open_leases(self) -> int:
        return len(self._leases)

    def lease_consumer(self, lease_id: str) -> str:
        return self._leases[lease_id].consumer

    def lease_sample_ids(self, lease_id: str) -> list[str]:
        return [entry.sample_id for entry in self._leases[lease_id].entries]

    # --- hand-out -----------------------------------------------------------------------------

    def lease(self, spec: PullSpec, now: float) -> Lease | None:
        """Lease a batch per `spec`, or None while too few samples are ready to fill one.

        A batch is full at `batch_size` samples. With whole groups it may also end early when the
        next group does not fit, and a group larger than the batch goes out alone.
        """
        queue = self._whole_ready if spec.whole_groups else self._partial_ready
        keys: Iterable[GroupKey]
        if self.canonical_order:
            ready = sorted(queue.oldest_first(), key=self._canonical_key)
            keys = ready if spec.policy is Policy.FIFO else self._rng.sample(ready, min(spec.batch_size, len(ready)))
        elif spec.policy is Policy.FIFO:
            keys = queue.oldest_first()
        else:
            keys = queue.random(self._rng, spec.batch_size)
        chosen: list[Entry] = []
        for key in keys:
            group = self._groups[key]
            room = spec.batch_size - len(chosen)
            members = self._members(group)
            if spec.whole_groups:
                if group.pending > room:
                    if not chosen:
                        chosen.extend(members)
                    break
                chosen.extend(members)
            else:
                pending = (e for e in members if e.state is EntryState.PENDING)
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

    def _canonical_key(self, key: GroupKey) -> tuple:
        """Hand-out order of a canonical buffer: groups trained before first (as arrival order puts them), then the
        oldest weight version, then the group's id: the same order whatever order the groups arrived in."""
        members = self._groups[key].members.values()
        return (not any(e.trained for e in members), min((e.oldest_version for e in members), default=-1), key)

    def _members(self, group: Group) -> list[Entry]:
        """A group's members in hand-out order: arrival, or by sample id in a canonical buffer."""
        members = list(group.members.values())
        return sorted(members, key=lambda e: e.sample_id) if self.canonical_order else members

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
