"""The replay buffer: the in-memory index (store.py) over the durable log (log.py).

Rules that keep "acknowledged means on disk" true:

- Every change is appended to the log before anyone is told about it: a Put answers after its
  PUT records are durable (commit.py), an Ack after its ACK record is.
- Put samples are handed out only once durable (STAGED until then), so a trainer never trains on
  a sample a crash could take back.
- A segment is deleted (compaction, at roll-over, right after the fsync that seals it) only when
  every sample it stored has been acked or dropped by a record appended before that fsync.
  Sample ids stay known for deduplication while their PUT's segment lives.
- Recovery replays the log from the first live segment's checkpoint: every sample put and not
  acked or dropped is pending again; leases are not logged, so open ones are simply delivered again.
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from google.protobuf.message import DecodeError

from protos import common_pb2
from protos.codec import CodecError
from protos.sample import Sample, SampleStatus
from services.buffer import metrics
from services.buffer.commit import Durability, FsyncPolicy
from services.buffer.config import BufferConfig
from services.buffer.log import HEADER, Location, LogCorruption, Record, RecordKind, SegmentLog
from services.buffer.records import (
    Checkpoint,
    decode_drop,
    decode_ids,
    decode_version,
    drop_record,
    ids_record,
    version_record,
)
from services.buffer.store import EntryState, NewSample, PullSpec, SampleStore

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
        self.store = SampleStore(config.capacity, config.max_staleness, config.seed)
        self.durability = Durability(
            segment_log, FsyncPolicy(config.fsync), config.fsync_window_ms / 1000, metrics.FSYNC_SECONDS.observe
        )
        self.accepted = 0
        self.acked = 0
        self.dropped: Counter[str] = Counter()
        self.duplicates = 0
        self.redelivered = 0
        self._segment_of: dict[str, int] = {}  # id -> segment of its PUT, for every id in a live segment
        self._ids_by_segment: defaultdict[int, list[str]] = defaultdict(list)
        self._held_by_segment: Counter[int] = Counter()  # samples still held, by their PUT's segment
        self._pending_changed = _Signal()  # wakes Pull
        self._room_freed = _Signal()  # wakes a blocked Put
        self._lease_closed = _Signal()  # wakes a Pull stream at its prefetch limit

    @classmethod
    def open(cls, config: BufferConfig) -> "ReplayBuffer":
        """Open the log in `config.data_dir` and recover every sample not yet acked or dropped."""
        segment_log = SegmentLog.open(config.data_dir, config.segment_bytes, Checkpoint().encode())
        buffer = cls(config, segment_log)
        buffer._recover()
        return buffer

    async def start(self) -> None:
        self.durability.start()
        for state in EntryState:
            metrics.SAMPLES.labels(state.value).set_function(lambda s=state: self.store.count(s))

    async def close(self) -> None:
        """Make everything appended durable and close the log."""
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
        for payload, sample in samples:
            if sample.sample_id not in self._segment_of and sample.sample_id not in seen:
                seen.add(sample.sample_id)
                fresh.append((payload, sample))
        return fresh

    def _stage(self, fresh: list[tuple[Payload, Sample]], duplicates: int) -> StagedPut:
        new = [_index_view(sample) for _, sample in fresh]
        self.store.check_groups(new)
        payloads = [payload for payload, _ in fresh]
        failed = [n.sample_id for n, (_, s) in zip(new, fresh) if s.status is SampleStatus.FAILED]
        failed_ids = set(failed)
        records = [(RecordKind.PUT, payload) for payload in payloads]
        if failed:  # a generation error is never a silent zero-reward sample: stored, and dropped
            records.append(drop_record("failed", failed))
        locations = self._append(records) if records else []
        held = []
        for sample, location in zip(new, locations):
            self._note_put(sample.sample_id, location.segment)
            if sample.sample_id in failed_ids:
                self.store.count_arrival(sample)
            else:
                held.append(replace(sample, ref=location))
                self._held_by_segment[location.segment] += 1
        self.store.add(held)
        self.accepted += len(new)
        self.duplicates += duplicates
        metrics.ACCEPTED.inc(len(new))
        metrics.ACCEPTED_BYTES.inc(sum(map(len, payloads)))
        metrics.DUPLICATES.inc(duplicates)
        if failed:
            self._count_drops("failed", len(failed))
        result = PutResult(accepted=len(new), duplicates=duplicates)
        return StagedPut([sample.sample_id for sample in held], self.log.appended, result)

    # --- Pull / Ack ---------------------------------------------------------------------------

    async def lease_batch(self, spec: PullSpec) -> LeasedBatch:
        """Wait until a batch per `spec` can be leased (the caller's deadline bounds the wait)."""
        while True:
            self._expire_leases()
            self._drop_stale()
            lease = self.store.lease(spec, self.clock())
            if lease is not None:
                break
            await self._pending_changed.wait(self._until_next_expiry())
        payloads = [self.log.read(entry.ref) for entry in lease.entries]
        metrics.PULLED.inc(len(payloads))
        return LeasedBatch(lease.lease_id, payloads, self.store.trainer_version)

    async def wait_for_acks(self, lease_ids: list[str], max_open: int) -> list[str]:
        """Wait until fewer than `max_open` of `lease_ids` are open; returns those still open."""
        while True:
            self._expire_leases()
            still_open = [lease_id for lease_id in lease_ids if self.store.is_open(lease_id)]
            if len(still_open) < max_open:
                return still_open
            await self._lease_closed.wait(self._until_next_expiry())

    def release(self, lease_id: str) -> None:
        """Give a leased batch back unused (it could not be delivered): pending again at once."""
        self.store.release(lease_id)
        self._pending_changed.fire()
        self._lease_closed.fire()

    async def ack(self, lease_id: str, trainer_version: int | None = None) -> int:
        """Close a lease for good (durably); returns the number of samples it held.

        Raises LeaseNotFound when the lease is unknown, already acked, or expired (then its
        samples were or will be delivered again).
        """
        self._expire_leases()
        done, reused = self.store.ack(lease_id)
        self._lease_closed.fire()
        records = []
        if done:
            records.append(ids_record(RecordKind.ACK, done))
        if reused:
            records.append(ids_record(RecordKind.USE, reused))
        stale = self._version_records(trainer_version, records)
        self._append(records)
        self._resolve(done)
        self.acked += len(done)
        metrics.ACKED.inc(len(done))
        self._account_stale(stale)
        if reused:
            self._pending_changed.fire()
        self._room_freed.fire()
        await self.durability.wait(self.log.appended)
        return len(done) + len(reused)

    async def set_version(self, version: int) -> int:
        """The trainer is at `version`; returns the number of pending samples dropped as stale."""
        records: list[tuple[RecordKind, bytes]] = []
        stale = self._version_records(version, records)
        self._append(records)
        self._account_stale(stale)
        await self.durability.wait(self.log.appended)
        return len(stale)

    def stats(self) -> BufferStats:
        self._expire_leases()
        return BufferStats(
            pending=self.store.count(EntryState.PENDING),
            leased=self.store.count(EntryState.LEASED),
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

    def _account_stale(self, stale: list[str]) -> None:
        if stale:
            self._resolve(stale)
            self._count_drops("stale", len(stale))
            self._room_freed.fire()

    def _count_drops(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        metrics.DROPPED.labels(reason).inc(count)

    def _expire_leases(self) -> None:
        expired = self.store.expire(self.clock())
        if expired:
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
        """Append records, rolling over (and compacting) first when the segment is full.

        Callers update their accounting only after this returns, so a checkpoint never counts a
        record that is not in an earlier segment, and compaction never relies on an unwritten one.
        """
        size = sum(HEADER.size + 1 + len(payload) for _, payload in records)
        if self.log.needs_roll(size):
            self.log.roll(self._checkpoint().encode())
            self._compact()
        return self.log.append(records)

    def _checkpoint(self) -> Checkpoint:
        return Checkpoint(
            accepted=self.accepted,
            acked=self.acked,
            dropped=self.dropped.copy(),
            trainer_version=self.store.trainer_version,
            open_groups=self.store.open_groups(),
        )

    def _compact(self) -> None:
        """Delete the oldest sealed segments whose samples are all acked or dropped."""
        for index in self.log.segments()[:-1]:
            if self._held_by_segment[index] > 0:
                break
            self.log.delete_segment(index)
            for sample_id in self._ids_by_segment.pop(index, []):
                del self._segment_of[sample_id]
            self._held_by_segment.pop(index, None)
            log.info("compacted log segment %d", index)

    def _note_put(self, sample_id: str, segment: int) -> None:
        self._segment_of[sample_id] = segment
        self._ids_by_segment[segment].append(sample_id)

    def _resolve(self, sample_ids: list[str]) -> None:
        for sample_id in sample_ids:
            self._held_by_segment[self._segment_of[sample_id]] -= 1

    # --- recovery -----------------------------------------------------------------------------

    def _recover(self) -> None:
        records = self.log.replay()
        first = next(records)
        if first.kind is not RecordKind.CHECKPOINT:
            raise LogCorruption(f"segment {first.location.segment} does not open with a checkpoint")
        checkpoint = Checkpoint.decode(first.payload)
        self.accepted, self.acked, self.dropped = checkpoint.accepted, checkpoint.acked, checkpoint.dropped
        self.store.trainer_version = checkpoint.trainer_version
        self.store.restore_groups(checkpoint.open_groups)
        failed_unrecorded: set[str] = set()  # FAILED puts whose DROP record was torn off
        for record in records:
            if record.kind is RecordKind.PUT:
                self._recover_put(record, failed_unrecorded)
            elif record.kind is RecordKind.ACK:
                sample_ids = decode_ids(record.payload)
                self._resolve(self.store.discard(sample_ids))
                self.acked += len(sample_ids)
            elif record.kind is RecordKind.USE:
                self.store.mark_used(decode_ids(record.payload))
            elif record.kind is RecordKind.DROP:
                reason, sample_ids = decode_drop(record.payload)
                failed_unrecorded.difference_update(sample_ids)
                self._resolve(self.store.discard(sample_ids))
                self.dropped[reason] += len(sample_ids)
            elif record.kind is RecordKind.VERSION:
                self.store.trainer_version = decode_version(record.payload)
        if failed_unrecorded:
            self._append([drop_record("failed", sorted(failed_unrecorded))])
            self.dropped["failed"] += len(failed_unrecorded)
        self._drop_stale()
        log.info(
            "recovered %s: %d samples pending, %d accepted, %d acked, dropped %s, trainer version %d%s",
            self.config.data_dir, len(self.store), self.accepted, self.acked, dict(self.dropped),
            self.store.trainer_version,
            f", cut a torn tail of {self.log.truncated_bytes} bytes" if self.log.truncated_bytes else "",
        )

    def _recover_put(self, record: Record, failed_unrecorded: set[str]) -> None:
        sample = _parse(record.payload)
        if sample.sample_id in self._segment_of:
            return
        new = replace(_index_view(sample), ref=record.location)
        self._note_put(sample.sample_id, record.location.segment)
        self.accepted += 1
        if sample.status is SampleStatus.FAILED:
            self.store.count_arrival(new)
            failed_unrecorded.add(sample.sample_id)
            return
        self.store.add([new])
        self.store.publish([sample.sample_id])
        self._held_by_segment[record.location.segment] += 1


def _parse(payload: Payload) -> Sample:
    """Decode and validate one serialized sample; CodecError (INVALID_ARGUMENT) names the problem."""
    try:
        msg = common_pb2.Sample.FromString(payload)
    except DecodeError as exc:
        raise CodecError(f"samples: not a valid relayrl.common.v1.Sample ({exc})") from None
    return Sample.from_proto(msg)


def _index_view(sample: Sample) -> NewSample:
    return NewSample(sample.sample_id, sample.group_id, sample.group_size, sample.oldest_version)
