"""The replay buffer: the in-memory index (store.py) over the durable log (log.py).

Rules that keep "acknowledged means on disk" true:

- Every change is appended to the log before anyone is told about it: a Put answers after its
  PUT records are durable (commit.py), an Ack after its ACK record is.
- Put samples are handed out only once durable (STAGED until then), so a trainer never trains on
  a sample a crash could take back.
- Compaction runs after a roll-over, once the caller's records are written (the index and the
  log agree then). It deletes sealed segments oldest first: those whose live bytes are at most
  `compact_live_ratio` of their size, and more while the whole log is larger than live bytes /
  ratio + 2 segments. Live bytes are the held samples' and the retired ids' hashes (8 bytes each).
  Before it deletes a segment it copies forward what must outlive it: each held sample (a COPY
  record: the stored bytes and the use count) and the hashes of the ids its records retired (a
  RETIRED record); then it fsyncs the active segment, then it deletes. The segment sealed last is
  spared while it holds samples (most are acked soon). So the log stays under about live bytes /
  ratio + 4 segments. A crash at any point leaves every fact in some segment:
  before the fsync the originals are all there; after it, the copies. Recovery keeps the first
  PUT of an id and moves it to the location of a later COPY.
- An id once stored is a duplicate for the life of the data dir: held ids are in the index, the
  others (acked, dropped; also the ids of groups done or closed) are hashes in retired.py, logged
  by the ACK, DROP and RETIRED records that compaction copies forward.
- Groups: one still incomplete `incomplete_group_timeout_s` after its first member arrived (in this
  process: a restart starts the wait again) is closed, its held members dropped ("incomplete_group").
  A member arriving for a group that is complete, closed or done is stored and dropped at once
  ("late_member"), so it never opens a group that cannot complete.
- Consumed leases: a trainer marks a lease consumed (trained on) and acks it only after its next
  checkpoint. ExtendLease(consumed) answers once a CONSUMED record of the lease's sample ids is
  durable; a lease expiring voids its samples' mark (a RETURNED record: the trainer that held them
  may have lost that training). Each lease is logged when handed out (a LEASE record, not waited
  for), so a lease lost in a restart can still be marked consumed by the trainer that trained it.
  Marks belong to the consumer that took the last lease (logged with each lease and checkpoint): a
  lease for another one (a restarted trainer names itself anew) voids them all (RETURNED), since
  what the replaced trainer trained after its last checkpoint is not in the new one's history.
  Compaction copies forward the CONSUMED marks of held samples and the LEASE records of open leases.
- Recovery replays the log from the first live segment's checkpoint: every sample put and not
  acked or dropped is pending again (open leases are simply delivered again); samples marked
  consumed go out first and are never dropped as stale (trained already: the trainer acks them).
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from google.protobuf.message import DecodeError

from protos import common_pb2
from protos.codec import CodecError
from protos.sample import Sample, SampleStatus
from services.buffer import metrics
from services.buffer.commit import Durability, FsyncPolicy
from services.buffer.config import BufferConfig
from services.buffer.entries import EntryState, NewSample, PullSpec
from services.buffer.log import HEADER, Location, LogCorruption, Record, RecordKind, SegmentLog
from services.buffer.records import (
    COPY_HEADER,
    Checkpoint,
    copy_record,
    decode_copy,
    decode_drop,
    decode_ids,
    decode_lease,
    decode_retired,
    decode_version,
    drop_record,
    ids_record,
    lease_record,
    retired_record,
    version_record,
)
from services.buffer.retired import RetiredIds, group_hash, sample_hashes
from services.buffer.store import SampleStore

log = logging.getLogger(__name__)

Payload = bytes | memoryview  # one serialized common_pb2.Sample


class BufferFull(Exception):
    """No room for a Put (after waiting, with back-pressure 'block')."""


@dataclass(frozen=True)
class PutResult:
    accepted: int  # samples newly stored
    duplicates: int  # samples whose id was stored already


@dataclass(frozen=True)
class StagedPut:
    """A Put written to the log, not yet durable; `commit_put` finishes it."""

    held_ids: list[str]
    position: int  # log position that must be durable (covers earlier copies of duplicates too)
    result: PutResult


@dataclass(frozen=True)
class LeasedBatch:
    lease_id: str
    payloads: list[bytes]  # serialized common_pb2.Sample, groups contiguous
    trainer_version: int


@dataclass(frozen=True)
class BufferStats:
    pending: int
    leased: int
    consumed: int  # of leased: in leases marked consumed
    staged: int
    acked: int
    dropped: dict[str, int]
    capacity: int
    accepted: int
    duplicates: int
    redelivered: int
    trainer_version: int
    max_staleness: int | None


class _Signal:
    """Wakes every current waiter at once; a wait sees only signals fired after it began."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        event = self._event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await event.wait()


class ReplayBuffer:
    """Put / lease / ack / set_version over a durable log. One event loop owns it."""

    def __init__(self, config: BufferConfig, segment_log: SegmentLog, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.log = segment_log
        self.clock = clock
        self.store = SampleStore(config.capacity, config.max_staleness, config.seed, self._group_done)
        self.retired = RetiredIds()
        self.durability = Durability(
            segment_log, FsyncPolicy(config.fsync), config.fsync_window_ms / 1000, metrics.FSYNC_SECONDS.observe
        )
        self.accepted = 0
        self.acked = 0
        self.dropped: Counter[str] = Counter()
        self.duplicates = 0
        self.redelivered = 0
        self._where: dict[str, Location] = {}  # held sample id -> its PUT (or COPY) payload
        self._held_in: defaultdict[int, dict[str, None]] = defaultdict(dict)  # segment -> held ids there, in order
        self._live_bytes: Counter[int] = Counter()  # segment -> what compaction must copy from it
        self._facts: defaultdict[int, list[np.ndarray]] = defaultdict(list)  # segment -> hashes it retired
        self._done_groups: list[int] = []  # hashes of groups done, not logged yet (the next append does)
        self._trained_at: dict[str, int] = {}  # held sample marked trained -> segment of its CONSUMED record
        self._trained_in: defaultdict[int, dict[str, None]] = defaultdict(dict)  # segment -> those ids
        self._lease_at: dict[str, int] = {}  # open lease -> segment of its LEASE record
        self._lost_leases: dict[str, tuple[str, list[str]]] = {}  # leases open at the last process's end -> (consumer, ids)
        self._consumer: str | None = None  # who took the last lease (marks are its, see extend_leases)
        self._started = False
        self._compact_due = False
        self._pending_changed = _Signal()  # wakes Pull
        self._room_freed = _Signal()  # wakes a blocked Put
        self._lease_closed = _Signal()  # wakes a Pull stream at its prefetch limit

    @classmethod
    def open(cls, config: BufferConfig, clock: Callable[[], float] = time.monotonic) -> "ReplayBuffer":
        """Open the log in `config.data_dir` and recover every sample not yet acked or dropped."""
        segment_log = SegmentLog.open(config.data_dir, config.segment_bytes, Checkpoint().encode())
        buffer = cls(config, segment_log, clock)
        buffer._recover()
        return buffer

    async def start(self) -> None:
        self.durability.start()
        for state in EntryState:
            metrics.SAMPLES.labels(state.value).set_function(lambda s=state: self.store.count(s))
        self._started = True
        self._compact_due = True  # whatever recovery found
        self._compact_if_due()

    async def close(self) -> None:
        """Make everything appended durable and close the log."""
        self._started = False
        await self.durability.close()
        self.log.close()

    # --- Put ----------------------------------------------------------------------------------

    async def put(self, payloads: Sequence[Payload]) -> PutResult:
        """Store serialized common_pb2.Sample messages; returns once they are durable."""
        return await self.commit_put(await self.stage_put(payloads))

    async def stage_put(self, payloads: Sequence[Payload]) -> StagedPut:
        """Validate, deduplicate and append serialized samples (stored as received, never
        re-encoded), waiting for room under back-pressure 'block'.

        Raises CodecError or GroupSizeConflict (bad input: nothing is stored) or BufferFull.
        """
        samples = [(payload, _parse(payload)) for payload in payloads]
        deadline = self.clock() + self.config.block_timeout_s
        while True:
            self._expire_groups()
            fresh = self._fresh(samples)
            need = sum(sample.status is not SampleStatus.FAILED for _, sample in fresh)
            if need <= self.store.free:
                return self._stage(fresh, duplicates=len(samples) - len(fresh))
            wait = deadline - self.clock()
            if need > self.store.capacity or self.config.backpressure == "reject" or wait <= 0:
                metrics.REJECTED.inc()
                raise BufferFull(
                    f"buffer full: {need} new samples, room for {self.store.free} of capacity "
                    f"{self.store.capacity}; retry after the trainer acks (the same sample ids are safe to resend)"
                )
            await self._room_freed.wait(wait)

    async def commit_put(self, staged: StagedPut) -> PutResult:
        """Wait until the staged samples are durable and pullable."""
        await asyncio.shield(self.finish_put(staged))
        return staged.result

    def finish_put(self, staged: StagedPut) -> asyncio.Future[None]:
        """Make the staged samples pullable once durable; the future completes then. Publishing
        happens even if nobody awaits the future any more (the samples are on disk either way)."""
        durable = self.durability.durable_future(staged.position)
        if durable.done():  # publish now: a done future would run its callbacks only on the next turn
            self._publish(staged, durable)
        else:  # runs before any awaiter of `durable` resumes (callbacks run in registration order)
            durable.add_done_callback(functools.partial(self._publish, staged))
        return durable

    def _publish(self, staged: StagedPut, durable: asyncio.Future[None]) -> None:
        if durable.cancelled() or durable.exception() is not None:
            return
        self.store.publish(staged.held_ids)
        if staged.held_ids:
            self._pending_changed.fire()

    def _fresh(self, samples: list[tuple[Payload, Sample]]) -> list[tuple[Payload, Sample]]:
        seen: set[str] = set()
        fresh = []
        retired = self.retired.contains(sample_hashes([sample.sample_id for _, sample in samples]))
        for (payload, sample), was_stored in zip(samples, retired.tolist()):
            sample_id = sample.sample_id
            if not was_stored and sample_id not in seen and sample_id not in self.store:
                seen.add(sample_id)
                fresh.append((payload, sample))
        return fresh

    def _stage(self, fresh: list[tuple[Payload, Sample]], duplicates: int) -> StagedPut:
        new = [_index_view(sample) for _, sample in fresh]
        self.store.check_groups(new)
        late = self._late_members(new)
        # Stored, and dropped: a generation error is never a silent zero-reward sample, and a late
        # member never opens a group that cannot complete.
        drops = {
            n.sample_id: "late_member" if n.sample_id in late else "failed"
            for n, (_, s) in zip(new, fresh)
            if n.sample_id in late or s.status is SampleStatus.FAILED
        }
        payloads = [payload for payload, _ in fresh]
        records = [(RecordKind.PUT, payload) for payload in payloads]
        dropped = _by_reason(drops)
        records += [drop_record(reason, sample_ids) for reason, sample_ids in dropped.items()]
        locations = self._append(records) if records else []
        now = self.clock()
        held = []
        for sample, location in zip(new, locations):
            reason = drops.get(sample.sample_id)
            if reason is None:
                held.append(replace(sample, ref=location))
            elif reason == "failed":  # a failed member still completes its group; a late one is no arrival
                self.store.count_arrival(sample, now)
        self.store.add(held, now)
        self._note_held(held)
        self.accepted += len(new)
        self.duplicates += duplicates
        metrics.ACCEPTED.inc(len(new))
        metrics.ACCEPTED_BYTES.inc(sum(map(len, payloads)))
        metrics.DUPLICATES.inc(duplicates)
        for reason, sample_ids in dropped.items():
            self._retire(sample_ids, self.log.active_segment)
            self._count_drops(reason, len(sample_ids))
        self._compact_if_due()
        result = PutResult(accepted=len(new), duplicates=duplicates)
        return StagedPut([sample.sample_id for sample in held], self.log.appended, result)

    # --- Pull / Ack ---------------------------------------------------------------------------

    async def lease_batch(self, spec: PullSpec) -> LeasedBatch:
        """Wait until a batch per `spec` can be leased (the caller's deadline bounds the wait)."""
        while True:
            self._expire_leases()
            self._expire_groups()
            self._switch_consumer(spec.consumer)
            self._drop_stale()
            lease = self.store.lease(spec, self.clock())
            if lease is not None:
                break
            await self._pending_changed.wait(self._until_next_expiry())
        self._append([lease_record(lease.lease_id, [entry.sample_id for entry in lease.entries], spec.consumer)])
        self._lease_at[lease.lease_id] = self.log.active_segment
        self._compact_if_due()
        payloads = [self.log.read(entry.ref) for entry in lease.entries]
        metrics.PULLED.inc(len(payloads))
        return LeasedBatch(lease.lease_id, payloads, self.store.trainer_version)

    async def wait_for_acks(self, lease_ids: list[str], max_open: int) -> list[str]:
        """Wait until fewer than `max_open` of `lease_ids` await training (open, not marked
        consumed: a consumed lease waits only for the trainer's checkpoint); returns those."""
        while True:
            self._expire_leases()
            still_open = [lease_id for lease_id in lease_ids if self.store.awaits_training(lease_id)]
            if len(still_open) < max_open:
                return still_open
            await self._lease_closed.wait(self._until_next_expiry())

    def release(self, lease_id: str) -> None:
        """Give a leased batch back unused (it could not be delivered): pending again at once."""
        self.store.release(lease_id)
        self._lease_at.pop(lease_id, None)
        self._pending_changed.fire()
        self._lease_closed.fire()

    async def ack(self, lease_id: str, trainer_version: int | None = None) -> int:
        """Close a lease for good (durably); returns the number of samples it held.

        Raises LeaseNotFound when the lease is unknown, already acked, or expired (then its
        samples were or will be delivered again).
        """
        self._expire_leases()
        done, reused = self.store.ack(lease_id)
        self._lease_at.pop(lease_id, None)
        self._lease_closed.fire()
        records = []
        if done:
            records.append(ids_record(RecordKind.ACK, done))
        if reused:
            records.append(ids_record(RecordKind.USE, reused))
        stale = self._version_records(trainer_version, records)
        self._append(records)
        self._resolve(done)
        self._retire(done, self.log.active_segment)
        self._forget_trained(reused)
        self.acked += len(done)
        metrics.ACKED.inc(len(done))
        self._account_stale(stale)
        self._compact_if_due()
        if reused:
            self._pending_changed.fire()
        self._room_freed.fire()
        await self.durability.wait(self.log.appended)
        return len(done) + len(reused)

    async def extend_leases(
        self, lease_ids: Sequence[str], lease_timeout_s: float, consumed: bool, trainer_version: int | None
    ) -> tuple[int, list[str]]:
        """Move the deadline of each open lease to now + `lease_timeout_s` (0: the configured
        default), mark them consumed if asked, and apply `trainer_version` as set_version does.
        Returns (leases extended, ids of those not open: expired, acked or unknown; the samples of
        an expired one were or will be delivered again, consumed or not).

        Marked consumed, a lease's samples are trained (see the module docstring): durably so when
        this returns. So are the samples of a lease open when the last buffer process ended (their
        trainer finished the step after the restart), if they are held still.
        """
        self._expire_leases()
        timeout = lease_timeout_s or self.config.lease_timeout_s
        newly = [lease_id for lease_id in dict.fromkeys(lease_ids) if consumed and self.store.awaits_training(lease_id)]
        missing = self.store.extend(lease_ids, self.clock() + timeout, consumed)
        if consumed:
            self._lease_closed.fire()  # a Pull stream's prefetch counts only leases awaiting training
            # Only the current consumer's training counts: one replaced by another lost what it trained since its
            # last checkpoint (see _switch_consumer).
            current = [lease_id for lease_id in newly if self.store.lease_consumer(lease_id) == self._consumer]
            trained = self.store.mark_trained([i for lease_id in current for i in self.store.lease_sample_ids(lease_id)])
            for lease_id in missing:
                lost = self._lost_leases.pop(lease_id, None)
                if lost is not None and lost[0] == self._consumer:
                    trained += self.store.mark_trained(lost[1])
            if trained:
                self._append([ids_record(RecordKind.CONSUMED, trained)])
                self._note_trained(trained, self.log.active_segment)
                self._compact_if_due()
        if trainer_version is not None:
            await self.set_version(trainer_version)
        elif consumed:
            await self.durability.wait(self.log.appended)
        return len(dict.fromkeys(lease_ids)) - len(missing), missing

    async def set_version(self, version: int) -> int:
        """The trainer is at `version`; returns the number of pending samples dropped as stale. The version it is at
        already (a pull's, after the ack that reported it) writes nothing: leasing drops what went stale since."""
        if version == self.store.trainer_version:
            return 0
        records: list[tuple[RecordKind, bytes]] = []
        stale = self._version_records(version, records)
        self._append(records)
        self._account_stale(stale)
        self._compact_if_due()
        await self.durability.wait(self.log.appended)
        return len(stale)

    def stats(self) -> BufferStats:
        self._expire_leases()
        self._expire_groups()
        return BufferStats(
            pending=self.store.count(EntryState.PENDING),
            leased=self.store.count(EntryState.LEASED),
            consumed=self.store.consumed,
            staged=self.store.count(EntryState.STAGED),
            acked=self.acked,
            dropped=dict(self.dropped),
            capacity=self.store.capacity,
            accepted=self.accepted,
            duplicates=self.duplicates,
            redelivered=self.redelivered,
            trainer_version=self.store.trainer_version,
            max_staleness=self.store.max_staleness,
        )

    # --- staleness, expiry --------------------------------------------------------------------

    def _version_records(self, version: int | None, records: list[tuple[RecordKind, bytes]]) -> list[str]:
        if version is None:
            return []
        stale = self.store.set_version(version)
        records.append(version_record(version))
        if stale:
            records.append(drop_record("stale", stale))
        return stale

    def _drop_stale(self) -> None:
        stale = self.store.drop_stale()
        if stale:
            self._append([drop_record("stale", stale)])
            self._account_stale(stale)
            self._compact_if_due()

    def _account_stale(self, stale: list[str]) -> None:
        if stale:
            self._resolve(stale)
            self._retire(stale, self.log.active_segment)
            self._count_drops("stale", len(stale))
            self._room_freed.fire()

    def _expire_groups(self) -> None:
        dropped = self.store.expire_groups(self.clock(), self.config.incomplete_group_timeout_s)
        if dropped:
            self._append([drop_record("incomplete_group", dropped)])
            self._resolve(dropped)
            self._retire(dropped, self.log.active_segment)
            self._count_drops("incomplete_group", len(dropped))
            log.info("dropped %d members of groups incomplete after %gs", len(dropped),
                     self.config.incomplete_group_timeout_s)
            self._compact_if_due()
            self._room_freed.fire()

    def _late_members(self, samples: list[NewSample]) -> set[str]:
        """Ids of group members beyond what their group still waits for (none once it is complete,
        closed or done: see retired.py)."""
        awaited: dict[str, int] = {}
        late = set()
        for sample in samples:
            if sample.group_size <= 1:
                continue
            group_id = sample.group_id
            if group_id not in awaited:
                known = self.store.awaited(group_id)
                if known is None:
                    known = 0 if self.retired.has_group(group_id) else sample.group_size
                awaited[group_id] = known
            if awaited[group_id] > 0:
                awaited[group_id] -= 1
            else:
                late.add(sample.sample_id)
        return late

    def _group_done(self, group_id: str) -> None:
        """The store forgot a group (complete and empty): later members of it are late."""
        key = group_hash(group_id)
        if key not in self.retired:
            self.retired.add(np.array([key], dtype=np.int64))
            self._done_groups.append(key)

    def _count_drops(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        metrics.DROPPED.labels(reason).inc(count)

    def _switch_consumer(self, consumer: str) -> None:
        """A lease for `consumer`: if it is not the one that took the last lease, a new trainer process replaced that
        one (or took over from it), and what the old one trained since its last checkpoint is not in the new one's
        history: every trained mark is void (a RETURNED record), and stale samples among them are dropped."""
        if consumer == self._consumer:
            return
        if self._consumer is not None:
            log.info("consumer %r takes over from %r", consumer, self._consumer)
        self._consumer = consumer
        voided = self.store.void_marks()
        if voided:
            self._append([ids_record(RecordKind.RETURNED, voided)])
            self._forget_trained(voided)
            log.info("%d samples marked trained by the consumer before are not trained for %r", len(voided), consumer)
            self._compact_if_due()

    def _expire_leases(self) -> None:
        expired = self.store.expire(self.clock())
        if expired:
            for lease in expired:
                self._lease_at.pop(lease.lease_id, None)
            returned = [e.sample_id for lease in expired for e in lease.entries if e.sample_id in self._trained_at]
            if returned:  # their marks are void in the store already
                self._append([ids_record(RecordKind.RETURNED, returned)])
                self._forget_trained(returned)
                self._compact_if_due()
            count = sum(len(lease.entries) for lease in expired)
            self.redelivered += count
            metrics.REDELIVERED.inc(count)
            log.info("%d lease(s) expired: %d samples pending again", len(expired), count)
            self._pending_changed.fire()
            self._lease_closed.fire()

    def _until_next_expiry(self) -> float:
        deadline = self.store.next_deadline()
        return 1.0 if deadline is None else min(1.0, deadline - self.clock())

    # --- the log ------------------------------------------------------------------------------

    def _append(self, records: list[tuple[RecordKind, bytes]]) -> list[Location]:
        """Append records, rolling over first when the segment is full (compaction follows once
        the caller is done); returns their locations. Groups done since the last append are logged
        first, as a RETIRED record.

        Callers update their accounting only after this returns, so a checkpoint never counts a
        record that is not in an earlier segment, and compaction never relies on an unwritten one.
        """
        done = np.array(self._done_groups, dtype=np.int64)
        if len(done):
            records = [retired_record(done), *records]
            self._done_groups = []
        size = sum(HEADER.size + 1 + len(payload) for _, payload in records)
        if self.log.needs_roll(size):
            self.log.roll(self._checkpoint().encode())
            self._compact_due = True
        locations = self.log.append(records)
        if len(done):
            self._note_facts(done, self.log.active_segment)
            return locations[1:]
        return locations

    def _checkpoint(self) -> Checkpoint:
        return Checkpoint(
            accepted=self.accepted,
            acked=self.acked,
            dropped=self.dropped.copy(),
            trainer_version=self.store.trainer_version,
            open_groups=self.store.open_groups(),
            consumer=self._consumer,
        )

    def _compact_if_due(self) -> None:
        """Compact after a roll-over. Called where the index, the log and the accounting agree: at
        the end of each operation that appends (recovery's in start())."""
        while self._compact_due and self._started:
            self._compact_due = False
            self._compact()

    def _compact(self) -> None:
        """Delete the oldest sealed segments the policy picks, after copying forward their held
        samples and the hashes their records retired (see the module docstring). Victims go in
        runs of about a segment's worth of copies, so a pass holds no more than that in memory."""
        run: list[int] = []
        for index in self._victims():
            run.append(index)
            if sum(self._live_bytes[i] for i in run) >= self.config.segment_bytes:
                self._copy_forward_and_delete(run)
                run = []
        if run:
            self._copy_forward_and_delete(run)

    def _copy_forward_and_delete(self, victims: list[int]) -> None:
        moved = [(sample_id, self._where[sample_id]) for index in victims for sample_id in self._held_in[index]]
        records = [copy_record(self.store.uses_of(sample_id), self.log.read(where)) for sample_id, where in moved]
        trained = [sample_id for index in victims for sample_id in self._trained_in.get(index, {})]
        if trained:
            records.append(ids_record(RecordKind.CONSUMED, trained))
        leases = [lease_id for lease_id, index in self._lease_at.items() if index in victims]
        records += [lease_record(lease_id, self.store.lease_sample_ids(lease_id), self.store.lease_consumer(lease_id))
                    for lease_id in leases]
        facts = [hashes for index in victims for hashes in self._facts.get(index, [])]
        retired = np.unique(np.concatenate(facts)) if facts else np.empty(0, dtype=np.int64)
        if len(retired):
            records.append(retired_record(retired))
        locations = self._append(records)
        for (sample_id, _), location in zip(moved, locations):
            self._move(sample_id, _copied_sample(location))
        self._forget_trained(trained)
        self._note_trained(trained, self.log.active_segment)
        for lease_id in leases:
            self._lease_at[lease_id] = self.log.active_segment
        if len(retired):
            self._note_facts(retired, self.log.active_segment)
        self.log.sync()  # the copies are durable before their originals go
        for index in victims:
            self.log.delete_segment(index)
            self._held_in.pop(index, None)
            self._live_bytes.pop(index, None)
            self._facts.pop(index, None)
            self._trained_in.pop(index, None)
        log.info("compacted log segments %s: copied %d held samples and %d retired ids forward",
                 victims, len(moved), len(retired))

    def _victims(self) -> list[int]:
        """Sealed segments to compact, oldest first: each one at most `compact_live_ratio` live,
        and any while the log is larger than live bytes / ratio + 2 segments; but not the one
        sealed last while it holds samples (most are acked soon: copying them would be waste)."""
        ratio = self.config.compact_live_ratio
        segments = self.log.segments()
        sizes = {index: self.log.segment_size(index) for index in segments}
        total = sum(sizes.values())
        limit = sum(self._live_bytes.values()) / ratio + 2 * self.config.segment_bytes
        victims = []
        sealed = segments[:-1]
        for index in sealed:
            live = self._live_bytes[index]
            if self._held_in[index] and (index == sealed[-1] or (live > ratio * sizes[index] and total <= limit)):
                break
            victims.append(index)
            total -= sizes[index] - live
        return victims

    def _note_held(self, samples: list[NewSample]) -> None:
        for sample in samples:
            self._place(sample.sample_id, sample.ref)

    def _move(self, sample_id: str, location: Location, uses: int | None = None) -> None:
        self._unplace(sample_id)
        self._place(sample_id, location)
        self.store.relocate(sample_id, location, uses)

    def _place(self, sample_id: str, location: Location) -> None:
        self._where[sample_id] = location
        self._held_in[location.segment][sample_id] = None
        self._live_bytes[location.segment] += location.length

    def _resolve(self, sample_ids: list[str]) -> None:
        """These samples are no longer held (their segments need not keep them)."""
        for sample_id in sample_ids:
            self._unplace(sample_id)
        self._forget_trained(sample_ids)

    def _unplace(self, sample_id: str) -> None:
        where = self._where.pop(sample_id)
        del self._held_in[where.segment][sample_id]
        self._live_bytes[where.segment] -= where.length

    def _note_trained(self, sample_ids: list[str], segment: int) -> None:
        """These held samples are marked trained by a CONSUMED record in `segment`."""
        self._forget_trained(sample_ids)
        for sample_id in sample_ids:
            self._trained_at[sample_id] = segment
            self._trained_in[segment][sample_id] = None
            self._live_bytes[segment] += _trained_bytes(sample_id)

    def _forget_trained(self, sample_ids: list[str]) -> None:
        for sample_id in sample_ids:
            segment = self._trained_at.pop(sample_id, None)
            if segment is not None:
                del self._trained_in[segment][sample_id]
                self._live_bytes[segment] -= _trained_bytes(sample_id)

    def _retire(self, sample_ids: list[str], segment: int) -> None:
        """These ids are done with, by a record in `segment`: duplicates from now on."""
        if sample_ids:
            hashes = sample_hashes(sample_ids)
            self.retired.add(hashes)
            self._note_facts(hashes, segment)

    def _note_facts(self, hashes: np.ndarray, segment: int) -> None:
        self._facts[segment].append(hashes)
        self._live_bytes[segment] += hashes.nbytes

    # --- recovery -----------------------------------------------------------------------------

    def _recover(self) -> None:
        records = self.log.replay()
        first = next(records)
        if first.kind is not RecordKind.CHECKPOINT:
            raise LogCorruption(f"segment {first.location.segment} does not open with a checkpoint")
        checkpoint = Checkpoint.decode(first.payload)
        self.accepted, self.acked, self.dropped = checkpoint.accepted, checkpoint.acked, checkpoint.dropped
        self.store.trainer_version = checkpoint.trainer_version
        self._consumer = checkpoint.consumer
        now = self.clock()
        self.store.restore_groups(checkpoint.open_groups, now)
        unrecorded: dict[str, str] = {}  # stored-and-dropped puts whose DROP record was torn off -> reason
        # Samples held again by a COPY are older than any PUT left (compaction copies from the
        # oldest segments): they are published first, so FIFO order survives compaction.
        puts: list[str] = []
        trained: dict[str, int] = {}  # sample id -> segment of the CONSUMED record marking it (order of marks)
        lease_of: dict[str, tuple[str, str]] = {}  # sample id -> (the last lease it went out in, its consumer)
        for record in records:
            segment = record.location.segment
            if record.kind is RecordKind.PUT:
                self._recover_put(record, unrecorded, now, puts)
            elif record.kind is RecordKind.COPY:
                self._recover_copy(record)
            elif record.kind is RecordKind.ACK:
                sample_ids = decode_ids(record.payload)
                self._resolve(self.store.discard(sample_ids))
                self._retire(sample_ids, segment)
                self.acked += len(sample_ids)
            elif record.kind is RecordKind.USE:
                sample_ids = decode_ids(record.payload)
                self.store.mark_used(sample_ids)
                for sample_id in sample_ids:  # handed out again: to be trained again
                    trained.pop(sample_id, None)
            elif record.kind is RecordKind.CONSUMED:
                for sample_id in decode_ids(record.payload):
                    trained.pop(sample_id, None)
                    trained[sample_id] = segment
            elif record.kind is RecordKind.RETURNED:
                for sample_id in decode_ids(record.payload):
                    trained.pop(sample_id, None)
            elif record.kind is RecordKind.LEASE:
                lease_id, sample_ids, consumer = decode_lease(record.payload)
                lease_of.update(dict.fromkeys(sample_ids, (lease_id, consumer)))
                self._consumer = consumer
            elif record.kind is RecordKind.DROP:
                reason, sample_ids = decode_drop(record.payload)
                for sample_id in sample_ids:
                    unrecorded.pop(sample_id, None)
                self._resolve(self.store.discard(sample_ids))
                self._retire(sample_ids, segment)
                self.dropped[reason] += len(sample_ids)
            elif record.kind is RecordKind.RETIRED:
                hashes = decode_retired(record.payload)
                self.retired.add(hashes)
                self._note_facts(hashes, segment)
            elif record.kind is RecordKind.VERSION:
                self.store.trainer_version = decode_version(record.payload)
        self.store.publish(puts)
        self._recover_trained(trained, lease_of)
        self.store.close_groups([g for g in self.store.incomplete_groups() if self.retired.has_group(g)])
        for reason, sample_ids in _by_reason(unrecorded).items():
            self._append([drop_record(reason, sample_ids)])
            self._retire(sample_ids, self.log.active_segment)
            self.dropped[reason] += len(sample_ids)
        self._drop_stale()
        log.info(
            "recovered %s: %d samples pending, %d accepted, %d acked, dropped %s, %d ids retired, "
            "trainer version %d%s",
            self.config.data_dir, len(self.store), self.accepted, self.acked, dict(self.dropped),
            len(self.retired), self.store.trainer_version,
            f", cut a torn tail of {self.log.truncated_bytes} bytes" if self.log.truncated_bytes else "",
        )

    def _recover_trained(self, trained: dict[str, int], lease_of: dict[str, tuple[str, str]]) -> None:
        """Mark the held samples trained that the log says are (their groups first in line); remember the
        leases open at the end of the last process, for a trainer that marks one consumed now."""
        held = [sample_id for sample_id in trained if sample_id in self.store]
        self.store.mark_trained(held)
        for sample_id in held:
            self._note_trained([sample_id], trained[sample_id])
        for sample_id, (lease_id, consumer) in lease_of.items():
            if sample_id in self.store and sample_id not in self._trained_at:
                self._lost_leases.setdefault(lease_id, (consumer, []))[1].append(sample_id)
        if held or self._lost_leases:
            log.info("%d samples in the log are trained and not acked (they go out first, never stale); %d leases "
                     "were open", len(held), len(self._lost_leases))

    def _recover_put(self, record: Record, unrecorded: dict[str, str], now: float, puts: list[str]) -> None:
        # A PUT precedes every record that retires its id (Put refuses retired ids, compaction
        # copies only held samples); an id seen twice is the original of a later COPY.
        sample = _parse(record.payload)
        if sample.sample_id in self.store:
            return
        new = replace(_index_view(sample), ref=record.location)
        self.accepted += 1
        if self._late_members([new]):
            unrecorded[sample.sample_id] = "late_member"
        elif sample.status is SampleStatus.FAILED:
            self.store.count_arrival(new, now)
            unrecorded[sample.sample_id] = "failed"
        else:
            self.store.add([new], now)
            self._note_held([new])
            puts.append(sample.sample_id)

    def _recover_copy(self, record: Record) -> None:
        """A held sample copied forward: it moves here, or (its PUT compacted away) is held again."""
        uses, payload = decode_copy(record.payload)
        sample = _parse(payload)
        location = _copied_sample(record.location)
        if sample.sample_id in self.store:
            self._move(sample.sample_id, location, uses)
        else:
            new = replace(_index_view(sample), ref=location)
            self.store.add_moved(new, uses)
            self.store.publish([sample.sample_id])
            self._note_held([new])


def _trained_bytes(sample_id: str) -> int:
    """What a sample's CONSUMED mark costs a segment that compaction copies it from (about)."""
    return len(sample_id) + 2


def _copied_sample(location: Location) -> Location:
    """Where the sample's bytes lie in a COPY record at `location` (after the use count)."""
    return Location(location.segment, location.offset + COPY_HEADER.size, location.length - COPY_HEADER.size)


def _by_reason(drops: dict[str, str]) -> dict[str, list[str]]:
    grouped: defaultdict[str, list[str]] = defaultdict(list)
    for sample_id, reason in drops.items():
        grouped[reason].append(sample_id)
    return dict(grouped)


def _parse(payload: Payload) -> Sample:
    """Decode and validate one serialized sample; CodecError (INVALID_ARGUMENT) names the problem."""
    try:
        msg = common_pb2.Sample.FromString(payload)
    except DecodeError as exc:
        raise CodecError(f"samples: not a valid relayrl.common.v1.Sample ({exc})") from None
    return Sample.from_proto(msg)


def _index_view(sample: Sample) -> NewSample:
    return NewSample(sample.sample_id, sample.group_id, sample.group_size, sample.oldest_version)
