"""Exactly-once consumption of leased batches: a heartbeat keeps leases open, acks wait for a checkpoint.

The trainer trains on a leased batch, marks its lease consumed (ExtendLease consumed=true with the new
weight version) and keeps holding it; only once a checkpoint that includes the step is durably saved does it
Ack the lease. The checkpoint records every sample trained and not yet acknowledged (the ledger, by lease).
A crash before the checkpoint: the leases expire and their samples come again, to be trained by the resumed
model, whose history lacks them. A crash after it: the resumed trainer acks the ledger's leases if they are
still open, and any redelivered sample the ledger names is acked without being trained again (it stays in the
ledger, and in later checkpoints, until an ack of it succeeds). An Ack answered NOT_FOUND (the lease expired,
or the buffer restarted) is "redelivered": logged, counted, never fatal.

The consumed marks, the checkpoint files and the acks after a checkpoint run in that order on one background
thread (LeaseCalls), off the training thread's critical path; a checkpoint first waits for what is queued, so
the ledger it stores holds exactly what is trained and not yet acked.

Without a checkpoint folder there is nothing durable to tie acks to: each lease is acked right after its step,
which is at-most-once across a trainer crash (what was acked is lost with the model that trained it). The
ledger still holds what a lost lease trained on, so a redelivery within the same process is not trained twice.
"""

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from protos.sample import Sample, SampleStatus
from trainer.buffer_client import LeasedBatch

log = logging.getLogger(__name__)


class LeaseSource(Protocol):
    """Where batches come from (the buffer client, or a dataset)."""

    def pull(self, batch_size: int, trainer_version: int | None = None) -> LeasedBatch: ...

    def ack(self, lease_id: str, trainer_version: int | None = None) -> int | None: ...

    def extend(self, lease_ids: list[str], consumed: bool = False, trainer_version: int | None = None) -> list[str]: ...

    def set_version(self, version: int) -> int: ...

    def trainer_version(self) -> int: ...


@dataclass
class Work:
    """What to do with one pulled batch: train `train`; the rest was trained before or FAILED."""

    lease_id: str
    train: list[Sample]
    already_trained: list[str] = field(default_factory=list)  # sample ids, acked without training again
    failed: int = 0  # FAILED members: counted, never trained on


class Ledger:
    """Samples trained in this model's history whose ack the buffer has not confirmed, by lease."""

    def __init__(self, entries: dict[str, list[str]] | None = None) -> None:
        self._by_lease: dict[str, list[str]] = {}
        self._lease_of: dict[str, str] = {}
        self._lock = threading.Lock()  # acks settle leases on the LeaseCalls thread
        for lease_id, sample_ids in (entries or {}).items():
            self.record(lease_id, sample_ids)

    def __contains__(self, sample_id: str) -> bool:
        with self._lock:
            return sample_id in self._lease_of

    def __len__(self) -> int:
        with self._lock:
            return len(self._lease_of)

    def record(self, lease_id: str, sample_ids: list[str]) -> None:
        """These samples (trained now, or before and redelivered) are held under `lease_id` now."""
        with self._lock:
            for sample_id in sample_ids:
                old = self._lease_of.get(sample_id)
                if old is not None and old != lease_id:
                    self._by_lease[old].remove(sample_id)
                    if not self._by_lease[old]:
                        del self._by_lease[old]
                if old != lease_id:
                    self._by_lease.setdefault(lease_id, []).append(sample_id)
                    self._lease_of[sample_id] = lease_id

    def settle(self, lease_id: str) -> None:
        """The buffer acknowledged `lease_id`: its samples are done for good."""
        with self._lock:
            for sample_id in self._by_lease.pop(lease_id, []):
                del self._lease_of[sample_id]

    def leases(self) -> list[str]:
        with self._lock:
            return list(self._by_lease)

    def entries(self) -> dict[str, list[str]]:
        """What a checkpoint stores (and `Ledger(entries)` restores)."""
        with self._lock:
            return {lease_id: list(ids) for lease_id, ids in self._by_lease.items()}


class LeaseCalls:
    """One daemon thread that runs buffer calls in the order they were submitted. An error stops it and is
    raised by the next `check` or `flush` on the training thread (as the heartbeat's)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="relayrl-lease-calls", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], object]) -> None:
        self.check()
        self._queue.put(call)

    def flush(self) -> None:
        """Wait until every call submitted so far has run."""
        self._queue.join()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError("a lease call to the buffer failed") from self._error

    def close(self, wait: bool = True) -> None:
        """Stop the thread after the calls submitted; `wait=False` returns at once (the daemon thread is left to its
        call, which may be retrying against a buffer that is gone)."""
        self._queue.put(None)
        if wait:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                if self._error is None:
                    call()
            except Exception as exc:  # noqa: BLE001 - re-raised on the training thread by check()
                self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()


class LeaseKeeper:
    """Keeps held leases open: a daemon thread extends all of them every `interval_s`.

    A lease the buffer reports missing is no longer extended (its samples come again). An error of the
    heartbeat itself (the buffer gone past the client's retry deadline) is raised by the next `check`.
    """

    def __init__(self, source: LeaseSource, interval_s: float) -> None:
        self.source = source
        self.interval_s = interval_s
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.lost = 0  # leases the heartbeat found gone
        self._thread = threading.Thread(target=self._run, name="relayrl-lease-heartbeat", daemon=True)
        self._thread.start()

    def hold(self, lease_id: str) -> None:
        with self._lock:
            self._held.add(lease_id)

    def drop(self, lease_id: str) -> None:
        with self._lock:
            self._held.discard(lease_id)

    def consume(self, lease_id: str, trainer_version: int) -> bool:
        """Mark a held lease trained on (and report the new version); False if the buffer lost it."""
        missing = self.source.extend([lease_id], consumed=True, trainer_version=trainer_version)
        if missing:
            log.warning("lease %s was gone from the buffer before its step finished: its samples come again and, "
                        "trained already, will be acked without training", lease_id)
            self.lost += 1
            self.drop(lease_id)
        return not missing

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError("the lease heartbeat failed") from self._error

    def close(self, wait: bool = True) -> None:
        self._stop.set()
        if wait:
            self._thread.join(timeout=self.interval_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                held = sorted(self._held)
            if not held:
                continue
            try:
                missing = self.source.extend(held)
            except Exception as exc:  # noqa: BLE001 - re-raised on the training thread by check()
                self._error = exc
                return
            for lease_id in missing:
                with self._lock:
                    if lease_id not in self._held:  # acked meanwhile
                        continue
                    self._held.discard(lease_id)
                log.warning("lease %s is gone from the buffer (expired or the buffer restarted): its samples "
                            "come again", lease_id)
                self.lost += 1


class LeaseBook:
    """Rank 0's side of exactly-once: what each pulled batch needs, the ledger, and when to ack."""

    def __init__(self, source: LeaseSource, interval_s: float, ack_on_checkpoint: bool,
                 ledger: dict[str, list[str]] | None = None) -> None:
        self.source = source
        self.keeper = LeaseKeeper(source, interval_s)
        self.calls = LeaseCalls()
        self.ack_on_checkpoint = ack_on_checkpoint
        self.ledger = Ledger(ledger)
        self._unacked: list[str] = self.ledger.leases()  # leases consumed since the last checkpoint (or resumed from it)
        self.acked = 0  # samples acknowledged
        self.redelivered = 0  # leases whose ack came back NOT_FOUND
        self.skipped = 0  # redelivered samples acked without training again
        self.failed = 0  # FAILED samples seen (never trained)

    def counters(self) -> dict[str, float]:
        """Running totals for the step metrics."""
        return {"acked_total": float(self.acked), "redelivered_leases": float(self.redelivered),
                "already_trained_total": float(self.skipped), "failed_total": float(self.failed),
                "lost_leases": float(self.keeper.lost), "unacked_samples": float(len(self.ledger))}

    def pull(self, batch_size: int, trainer_version: int | None = None) -> LeasedBatch:
        """Pull a batch to train at `trainer_version` and hold its lease from this moment on (also while it waits
        as a prefetch). The pull carries the version: the consumed mark that reports it runs on another thread
        and may reach the buffer after the pull, which would then filter by the version before."""
        batch = self.source.pull(batch_size, trainer_version)
        self.keeper.hold(batch.lease_id)
        return batch

    def work(self, batch: LeasedBatch) -> Work:
        self.keeper.check()
        self.calls.check()
        failed = [s for s in batch.samples if s.status is SampleStatus.FAILED]
        usable = [s for s in batch.samples if s.status is not SampleStatus.FAILED]
        done = [s.sample_id for s in usable if s.sample_id in self.ledger]
        if done:
            log.info("lease %s: %d redelivered sample(s) were trained already: acking them without training",
                     batch.lease_id, len(done))
        self.failed += len(failed)
        self.skipped += len(done)
        return Work(batch.lease_id, [s for s in usable if s.sample_id not in self.ledger], done, len(failed))

    def consumed(self, work: Work, trainer_version: int) -> None:
        """`work` is trained (its model state is the trainer's now): ack it, or hold it until the checkpoint."""
        self.ledger.record(work.lease_id, [s.sample_id for s in work.train] + work.already_trained)
        lease_id = work.lease_id
        if not self.ack_on_checkpoint:
            self.calls.submit(lambda: self._ack(lease_id, trainer_version))
            return
        self.calls.submit(lambda: self.keeper.consume(lease_id, trainer_version))
        self._unacked.append(lease_id)

    def flush(self) -> None:
        """Wait until every buffer call submitted so far has run: consumed marks (before a checkpoint is saved),
        acks."""
        self.calls.flush()

    def checkpointed(self, trainer_version: int) -> None:
        """A checkpoint holding every consumed lease's training is durable: ack them all (in the background)."""
        leases, self._unacked = self._unacked, []
        for lease_id in leases:
            self.calls.submit(lambda lease_id=lease_id: self._ack(lease_id, trainer_version))

    def close(self, wait: bool = True) -> None:
        """Finish the calls submitted (acks of the last checkpoint) and stop the threads. `wait=False` (Ctrl-C) waits
        for none of it: an ack not sent leaves its lease to be redelivered, and the checkpoint's ledger acks its
        samples without training them again."""
        try:
            if wait:
                self.calls.flush()
        finally:
            self.calls.close(wait)
            self.keeper.close(wait)

    def _ack(self, lease_id: str, trainer_version: int) -> None:
        self.keeper.drop(lease_id)
        acked = self.source.ack(lease_id, trainer_version)
        if acked is None:
            self.redelivered += 1
            log.warning("ack of lease %s: NOT_FOUND (it expired or the buffer restarted): its samples come again "
                        "and, trained already, will be acked without training", lease_id)
            return
        self.acked += acked
        self.ledger.settle(lease_id)
