"""The replay buffer: the in-memory index (index.py, leased out by store.py) over the durable log (log.py).

ReplayBuffer is one state machine that one event loop owns; its state is declared here, its operations
are grouped by concern, each in a part of the class of its own module:

    intake.py       Put: validate, deduplicate, append, publish once durable
    handout.py      Pull, Ack, ExtendLease, SetVersion; expired leases, stale samples, incomplete groups
    compaction.py   appending to the log, roll-over and compaction (what each segment keeps: segments.py)
    recovery.py     rebuilding the index from the log on open

Rules that keep "acknowledged means on disk" true:

- Every change is appended to the log before anyone is told about it: a Put answers after its
  PUT records are durable (commit.py), an Ack after its ACK record is.
- Put samples are handed out only once durable (STAGED until then), so a trainer never trains on
  a sample a crash could take back.
- Compaction copies forward what a segment holds that must outlive it before it deletes the segment
  (compaction.py), so a crash at any point leaves every fact in some segment.
- An id once stored is a duplicate for the life of the data dir: held ids are in the index, the
  others (acked, dropped; also the ids of groups done or closed) are hashes in retired.py, logged
  by the ACK, DROP and RETIRED records that compaction copies forward.
- Groups: one still incomplete `incomplete_group_timeout_s` after its first member arrived (in this
  process: a restart starts the wait again) is closed, its held members dropped ("incomplete_group").
  A member arriving for a group that is complete, closed or done is stored and dropped at once
  ("late_member"), so it never opens a group that cannot complete.
- Consumed leases (handout.py): a trainer marks a lease consumed (trained on) and acks it only after
  its next checkpoint; marks survive restarts and compaction, and belong to the consumer that took the
  last lease.
- Recovery replays the log from the first live segment's checkpoint (recovery.py).
- Images are stored once by hash beside the log (images.py), counted by the held samples that refer to them, and
  deleted once the record that let the last of those go is durable (`_forget`).
"""

import asyncio
import contextlib
import functools
import logging
import pathlib
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from services.buffer import metrics
from services.buffer.commit import Durability, FsyncPolicy
from services.buffer.compaction import Compaction
from services.buffer.config import BufferConfig
from services.buffer.entries import EntryState
from services.buffer.handout import Handout
from services.buffer.images import ImageStore
from services.buffer.intake import Intake
from services.buffer.log import Location, SegmentLog
from services.buffer.records import Checkpoint
from services.buffer.recovery import Recovery
from services.buffer.results import BufferStats
from services.buffer.retired import RetiredIds, group_hash, sample_hashes
from services.buffer.segments import SegmentLiveness
from services.buffer.store import SampleStore

log = logging.getLogger(__name__)


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


class ReplayBuffer(Intake, Handout, Recovery, Compaction):
    """Put / lease / ack / set_version over a durable log. One event loop owns it."""

    def __init__(self, config: BufferConfig, segment_log: SegmentLog, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.log = segment_log
        self.clock = clock
        self.store = SampleStore(config.capacity, config.max_staleness, config.seed, self._group_done,
                                 config.canonical_order)
        self.retired = RetiredIds()
        self.images = ImageStore(pathlib.Path(config.data_dir) / "images", fsync=config.fsync != "never")
        self.durability = Durability(
            segment_log, FsyncPolicy(config.fsync), config.fsync_window_ms / 1000, metrics.FSYNC_SECONDS.observe
        )
        self.accepted = 0
        self.acked = 0
        self.dropped: Counter[str] = Counter()
        self.duplicates = 0
        self.redelivered = 0
        self.live = SegmentLiveness()  # what each segment holds that must outlive it (compaction reads it)
        self._done_groups: list[int] = []  # hashes of groups done, not logged yet (the next append does)
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
        metrics.IMAGES.set_function(lambda: len(self.images.counts))
        self._started = True
        self._compact_due = True  # whatever recovery found
        self._compact_if_due()
        await self.durability.wait(self.log.appended)  # the drops recovery logged, before their images go
        freed = self.images.sweep()
        if freed:
            log.info("deleted %d bytes of images no held sample refers to", freed)

    async def close(self) -> None:
        """Make everything appended durable and close the log."""
        self._started = False
        await self.durability.close()
        self.log.close()

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

    # --- what the parts share -----------------------------------------------------------------

    def _group_done(self, group_id: str) -> None:
        """The store forgot a group (complete and empty): later members of it are late."""
        key = group_hash(group_id)
        if key not in self.retired:
            self.retired.add(np.array([key], dtype=np.int64))
            self._done_groups.append(key)

    def _count_drops(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        metrics.DROPPED.labels(reason).inc(count)

    def _forget(self, sample_ids: list[str]) -> None:
        """These samples are no longer held (acked, dropped): their log records and images need not be kept. An
        image no held sample refers to is deleted once what was just appended (the record letting its last sample
        go) is durable; recovery counts afresh (and start() deletes what nobody refers to)."""
        self.live.resolve(sample_ids)
        unused = self.images.release(sample_ids)
        if unused and self._started:
            durable = self.durability.durable_future(self.log.appended)
            durable.add_done_callback(functools.partial(self._delete_images, unused))

    def _delete_images(self, unused: list[bytes], durable: asyncio.Future[None]) -> None:
        if not durable.cancelled() and durable.exception() is None:  # else kept: the next start() deletes them
            metrics.IMAGE_BYTES_FREED.inc(self.images.delete(unused))

    def _move(self, sample_id: str, location: Location, uses: int | None = None) -> None:
        self.live.move(sample_id, location)
        self.store.relocate(sample_id, location, uses)

    def _retire(self, sample_ids: list[str], segment: int) -> None:
        """These ids are done with, by a record in `segment`: duplicates from now on."""
        if sample_ids:
            hashes = sample_hashes(sample_ids)
            self.retired.add(hashes)
            self.live.note_facts(hashes, segment)
