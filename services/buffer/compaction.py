"""Writing the replay buffer's log: appends, roll-overs (each new segment opens with a checkpoint) and
compaction, which keeps the log bounded by the live data.

Compaction runs after a roll-over, once the caller's records are written (the index and the log agree
then). It deletes sealed segments oldest first: those whose live bytes are at most `compact_live_ratio`
of their size, and more while the whole log is larger than live bytes / ratio + 2 segments. Live bytes
are the held samples' and the retired ids' hashes (8 bytes each; segments.py keeps the count). Before it
deletes a segment it copies forward what must outlive it: each held sample (a COPY record: the stored
bytes and the use count) and the hashes of the ids its records retired (a RETIRED record); then it
fsyncs the active segment, then it deletes. The segment sealed last is spared while it holds samples
(most are acked soon). So the log stays under about live bytes / ratio + 4 segments. A crash at any
point leaves every fact in some segment: before the fsync the originals are all there; after it, the
copies. Recovery (recovery.py) keeps the first PUT of an id and moves it to the location of a later COPY.
Compaction also copies forward the CONSUMED marks of held samples and the LEASE records of open leases.
"""

import logging

import numpy as np

from services.buffer.log import HEADER, Location, RecordKind
from services.buffer.records import (
    COPY_HEADER,
    Checkpoint,
    copy_record,
    ids_record,
    lease_record,
    retired_record,
)

log = logging.getLogger(__name__)


class Compaction:
    """ReplayBuffer's log writing and compaction (a part of ReplayBuffer: it works on the state
    ReplayBuffer.__init__ declares)."""

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
            self.live.note_facts(done, self.log.active_segment)
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
            if sum(self.live.live_bytes[i] for i in run) >= self.config.segment_bytes:
                self._copy_forward_and_delete(run)
                run = []
        if run:
            self._copy_forward_and_delete(run)

    def _copy_forward_and_delete(self, victims: list[int]) -> None:
        moved = [(sample_id, self.live.where[sample_id])
                 for index in victims for sample_id in self.live.held_in[index]]
        records = [copy_record(self.store.uses_of(sample_id), self.log.read(where)) for sample_id, where in moved]
        trained = [sample_id for index in victims for sample_id in self.live.trained_in.get(index, {})]
        if trained:
            records.append(ids_record(RecordKind.CONSUMED, trained))
        leases = [lease_id for lease_id, index in self.live.lease_at.items() if index in victims]
        records += [lease_record(lease_id, self.store.lease_sample_ids(lease_id), self.store.lease_consumer(lease_id))
                    for lease_id in leases]
        facts = [hashes for index in victims for hashes in self.live.facts.get(index, [])]
        retired = np.unique(np.concatenate(facts)) if facts else np.empty(0, dtype=np.int64)
        if len(retired):
            records.append(retired_record(retired))
        locations = self._append(records)
        for (sample_id, _), location in zip(moved, locations):
            self._move(sample_id, copied_sample(location))
        self.live.forget_trained(trained)
        self.live.note_trained(trained, self.log.active_segment)
        for lease_id in leases:
            self.live.lease_at[lease_id] = self.log.active_segment
        if len(retired):
            self.live.note_facts(retired, self.log.active_segment)
        self.log.sync()  # the copies are durable before their originals go
        for index in victims:
            self.log.delete_segment(index)
            self.live.forget_segment(index)
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
        limit = sum(self.live.live_bytes.values()) / ratio + 2 * self.config.segment_bytes
        victims = []
        sealed = segments[:-1]
        for index in sealed:
            live = self.live.live_bytes[index]
            if self.live.held_in[index] and (
                    index == sealed[-1] or (live > ratio * sizes[index] and total <= limit)):
                break
            victims.append(index)
            total -= sizes[index] - live
        return victims


def copied_sample(location: Location) -> Location:
    """Where the sample's bytes lie in a COPY record at `location` (after the use count)."""
    return Location(location.segment, location.offset + COPY_HEADER.size, location.length - COPY_HEADER.size)
