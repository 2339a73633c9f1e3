"""The Pull side of the replay buffer: leases, acks, consumed marks, the trainer's version, and what
time takes away (expired leases, stale samples, groups that never complete).

- An Ack answers once its ACK record is durable.
- Groups: one still incomplete `incomplete_group_timeout_s` after its first member arrived (in this
  process: a restart starts the wait again) is closed, its held members dropped ("incomplete_group").
- Consumed leases: a trainer marks a lease consumed (trained on) and acks it only after its next
  checkpoint. ExtendLease(consumed) answers once a CONSUMED record of the lease's sample ids is
  durable; a lease expiring voids its samples' mark (a RETURNED record: the trainer that held them
  may have lost that training). Each lease is logged when handed out (a LEASE record, not waited
  for), so a lease lost in a restart can still be marked consumed by the trainer that trained it.
  Marks belong to the consumer that took the last lease (logged with each lease and checkpoint): a
  lease for another one (a restarted trainer names itself anew) voids them all (RETURNED), since
  what the replaced trainer trained after its last checkpoint is not in the new one's history.
  Compaction copies forward the CONSUMED marks of held samples and the LEASE records of open leases.
"""

import logging
from collections.abc import Sequence

from services.buffer import metrics
from services.buffer.entries import PullSpec
from services.buffer.log import RecordKind
from services.buffer.records import drop_record, ids_record, lease_record, version_record
from services.buffer.results import LeasedBatch

log = logging.getLogger(__name__)


class Handout:
    """ReplayBuffer's Pull, Ack, ExtendLease and SetVersion, with the expiry and staleness rules they
    apply (a part of ReplayBuffer: it works on the state ReplayBuffer.__init__ declares)."""

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
        self.live.lease_at[lease.lease_id] = self.log.active_segment
        self._compact_if_due()
        payloads = [self._handed_out(entry.sample_id, self.log.read(entry.ref)) for entry in lease.entries]
        metrics.PULLED.inc(len(payloads))
        return LeasedBatch(lease.lease_id, payloads, self.store.trainer_version)

    def _handed_out(self, sample_id: str, payload: bytes) -> bytes:
        """A stored sample as a trainer gets it: with its images' bytes (images.py)."""
        return self.images.inline(payload) if sample_id in self.images.refs else payload

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
        self.live.lease_at.pop(lease_id, None)
        self._pending_changed.fire()
        self._lease_closed.fire()

    async def ack(self, lease_id: str, trainer_version: int | None = None) -> int:
        """Close a lease for good (durably); returns the number of samples it held.

        Raises LeaseNotFound when the lease is unknown, already acked, or expired (then its
        samples were or will be delivered again).
        """
        self._expire_leases()
        done, reused = self.store.ack(lease_id)
        self.live.lease_at.pop(lease_id, None)
        self._lease_closed.fire()
        records = []
        if done:
            records.append(ids_record(RecordKind.ACK, done))
        if reused:
            records.append(ids_record(RecordKind.USE, reused))
        stale = self._version_records(trainer_version, records)
        self._append(records)
        self._forget(done)
        self._retire(done, self.log.active_segment)
        self.live.forget_trained(reused)
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
                self.live.note_trained(trained, self.log.active_segment)
                self._compact_if_due()
        if trainer_version is not None:
            await self.set_version(trainer_version)
        elif consumed:
            await self.durability.wait(self.log.appended)
        return len(dict.fromkeys(lease_ids)) - len(missing), missing

    async def set_version(self, version: int) -> int:
        """The trainer is at `version`; returns the number of pending samples dropped as stale. The version it is at
        already (a pull's, after the ack that reported it) writes nothing: leasing drops what went stale since; nor
        does an older one (versions only grow: SampleIndex.set_version)."""
        if version <= self.store.trainer_version:
            return 0
        records: list[tuple[RecordKind, bytes]] = []
        stale = self._version_records(version, records)
        self._append(records)
        self._account_stale(stale)
        self._compact_if_due()
        await self.durability.wait(self.log.appended)
        return len(stale)

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
            self._forget(stale)
            self._retire(stale, self.log.active_segment)
            self._count_drops("stale", len(stale))
            self._room_freed.fire()

    def _expire_groups(self) -> None:
        dropped = self.store.expire_groups(self.clock(), self.config.incomplete_group_timeout_s)
        if dropped:
            self._append([drop_record("incomplete_group", dropped)])
            self._forget(dropped)
            self._retire(dropped, self.log.active_segment)
            self._count_drops("incomplete_group", len(dropped))
            log.info("dropped %d members of groups incomplete after %gs", len(dropped),
                     self.config.incomplete_group_timeout_s)
            self._compact_if_due()
            self._room_freed.fire()

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
            self.live.forget_trained(voided)
            log.info("%d samples marked trained by the consumer before are not trained for %r", len(voided), consumer)
            self._compact_if_due()

    def _expire_leases(self) -> None:
        expired = self.store.expire(self.clock())
        if expired:
            for lease in expired:
                self.live.lease_at.pop(lease.lease_id, None)
            returned = [e.sample_id for lease in expired for e in lease.entries
                        if e.sample_id in self.live.trained_at]
            if returned:  # their marks are void in the store already
                self._append([ids_record(RecordKind.RETURNED, returned)])
                self.live.forget_trained(returned)
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
