"""Recovery of the replay buffer: rebuild the index from the log when a buffer opens.

It replays the log from the first live segment's checkpoint: every sample put and not acked or dropped is
pending again (open leases are simply delivered again); samples marked consumed go out first and are never
dropped as stale (trained already: the trainer acks them). A PUT of an id seen before is the original of
a later COPY (compaction.py): the first PUT is kept and moved to the COPY's location. The images the held samples
refer to are counted again (images.py); start() then deletes those no held sample refers to.
"""

import logging
from dataclasses import replace

from protos.sample import SampleStatus
from services.buffer.compaction import copied_sample
from services.buffer.images import stored_hashes
from services.buffer.intake import by_reason, index_view, parse_sample
from services.buffer.log import LogCorruption, Record, RecordKind
from services.buffer.records import (
    Checkpoint,
    decode_copy,
    decode_drop,
    decode_ids,
    decode_lease,
    decode_retired,
    decode_version,
    drop_record,
)

log = logging.getLogger(__name__)


class Recovery:
    """ReplayBuffer's recovery (a part of ReplayBuffer: it works on the state ReplayBuffer.__init__
    declares)."""

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
                self._forget(self.store.discard(sample_ids))
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
                self._forget(self.store.discard(sample_ids))
                self._retire(sample_ids, segment)
                self.dropped[reason] += len(sample_ids)
            elif record.kind is RecordKind.RETIRED:
                hashes = decode_retired(record.payload)
                self.retired.add(hashes)
                self.live.note_facts(hashes, segment)
            elif record.kind is RecordKind.VERSION:
                self.store.trainer_version = decode_version(record.payload)
        self.store.publish(puts)
        self._recover_trained(trained, lease_of)
        self.store.close_groups([g for g in self.store.incomplete_groups() if self.retired.has_group(g)])
        for reason, sample_ids in by_reason(unrecorded).items():
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
            self.live.note_trained([sample_id], trained[sample_id])
        for sample_id, (lease_id, consumer) in lease_of.items():
            if sample_id in self.store and sample_id not in self.live.trained_at:
                self._lost_leases.setdefault(lease_id, (consumer, []))[1].append(sample_id)
        if held or self._lost_leases:
            log.info("%d samples in the log are trained and not acked (they go out first, never stale); %d leases "
                     "were open", len(held), len(self._lost_leases))

    def _recover_put(self, record: Record, unrecorded: dict[str, str], now: float, puts: list[str]) -> None:
        # A PUT precedes every record that retires its id (Put refuses retired ids, compaction
        # copies only held samples); an id seen twice is the original of a later COPY.
        sample = parse_sample(record.payload)
        if sample.sample_id in self.store:
            return
        new = replace(index_view(sample), ref=record.location)
        self.accepted += 1
        if self._late_members([new]):
            unrecorded[sample.sample_id] = "late_member"
        elif sample.status is SampleStatus.FAILED:
            self.store.count_arrival(new, now)
            unrecorded[sample.sample_id] = "failed"
        else:
            self.store.add([new], now)
            self.live.note_held([new])
            self.images.hold(sample.sample_id, stored_hashes(sample.images))
            puts.append(sample.sample_id)

    def _recover_copy(self, record: Record) -> None:
        """A held sample copied forward: it moves here, or (its PUT compacted away) is held again."""
        uses, payload = decode_copy(record.payload)
        sample = parse_sample(payload)
        location = copied_sample(record.location)
        if sample.sample_id in self.store:
            self._move(sample.sample_id, location, uses)
        else:
            new = replace(index_view(sample), ref=location)
            self.store.add_moved(new, uses)
            self.store.publish([sample.sample_id])
            self.live.note_held([new])
            self.images.hold(sample.sample_id, stored_hashes(sample.images))
