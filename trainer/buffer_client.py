"""The trainer's client of the replay buffer: pull leased batches, keep their leases open, ack them.

Every call survives a buffer restart: UNAVAILABLE and DEADLINE_EXCEEDED are retried with backoff, on a
fresh channel, for up to buffer.retry_deadline_s. Each call is safe to repeat: a repeated Ack of a lease
the first try did close answers NOT_FOUND, which `ack` reports as "not acked here" (None) like any lease
the buffer no longer holds (expired, or lost in the buffer's restart: its samples come again).
"""

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from protos import buffer_pb2, buffer_pb2_grpc
from protos.sample import Sample
from services.client import connect_sync
from trainer.config.buffer import BufferClientConfig

log = logging.getLogger(__name__)

# Worth another try: no batch ready yet (Pull), or the buffer is restarting.
_RETRYABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
_RETRY_PAUSE_S = 0.2
_MAX_PAUSE_S = 2.0


class BufferUnavailable(ConnectionError):
    """The buffer did not answer within buffer.retry_deadline_s."""


@dataclass
class LeasedBatch:
    """Samples under a lease: redelivered by the buffer unless acked in time."""

    lease_id: str
    samples: list[Sample]
    trainer_version: int


class BufferClient:
    """A blocking gRPC client of relayrl.buffer.v1.Buffer; every call has a deadline. Thread-safe (the
    lease heartbeat and a prefetching pull call it beside the training loop)."""

    def __init__(self, config: BufferClientConfig, call_timeout_s: float = 30.0) -> None:
        if config.address is None:
            raise ValueError("buffer.address: the trainer needs the buffer's host:port")
        self.config = config
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._channels: list[grpc.Channel] = []
        self._stub: buffer_pb2_grpc.BufferStub | None = None
        self._connect(None)

    def _connect(self, failed: buffer_pb2_grpc.BufferStub | None) -> buffer_pb2_grpc.BufferStub:
        """A fresh channel (it connects at once, where the failed one may sit in reconnect backoff), unless
        another thread already replaced the failed stub. Old channels stay open for calls still on them."""
        with self._lock:
            if self._stub is failed:
                self._channels.append(connect_sync(self.config.address, self.config.client))
                self._stub = buffer_pb2_grpc.BufferStub(self._channels[-1])
            return self._stub

    def _call(self, method: str, request, what: str):
        """One unary call, retried on UNAVAILABLE / DEADLINE_EXCEEDED up to buffer.retry_deadline_s."""
        deadline = time.monotonic() + self.config.retry_deadline_s
        pause = _RETRY_PAUSE_S
        while True:
            stub = self._stub
            try:
                return getattr(stub, method)(request, timeout=self.call_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                if time.monotonic() + pause >= deadline:
                    raise BufferUnavailable(
                        f"{what}: the buffer at {self.config.address} did not answer within "
                        f"{self.config.retry_deadline_s:.0f}s (last: {exc.code().name}: {exc.details()})"
                    ) from exc
                log.warning("%s: %s from the buffer, retrying in %.1fs", what, exc.code().name, pause)
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self._connect(stub)
                time.sleep(pause)
                pause = min(2 * pause, _MAX_PAUSE_S)

    def pull(self, batch_size: int, trainer_version: int | None = None) -> LeasedBatch:
        """Wait (up to buffer.max_wait_s) for one leased batch of about `batch_size` samples, none of them more
        than the buffer's max_staleness behind `trainer_version` (the version the batch will train at)."""
        request = buffer_pb2.PullRequest(
            batch_size=batch_size,
            allow_partial_groups=self.config.allow_partial_groups,
            max_batches=1,
            lease_timeout_s=self.config.lease_timeout_s,
            consumer=self.config.consumer,
            trainer_version=trainer_version,
        )
        deadline = time.monotonic() + self.config.max_wait_s
        while True:
            stub = self._stub
            try:
                for batch in stub.Pull(request, timeout=self.config.pull_timeout_s):
                    return LeasedBatch(
                        lease_id=batch.lease_id,
                        samples=[Sample.from_proto(msg) for msg in batch.samples],
                        trainer_version=batch.trainer_version,
                    )
                outcome = "stream ended without a batch"
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self._connect(stub)
                outcome = exc.code().name
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no batch of {batch_size} samples from the buffer at {self.config.address} "
                    f"within {self.config.max_wait_s:.0f}s (last: {outcome})"
                )
            log.info("waiting for a batch from the buffer (%s)", outcome)
            time.sleep(_RETRY_PAUSE_S)

    def ack(self, lease_id: str, trainer_version: int | None = None) -> int | None:
        """Acknowledge a lease; returns the samples acked, or None when the buffer no longer holds the lease
        (NOT_FOUND: it expired or the buffer restarted, so its samples are delivered again; or an earlier
        try of this very ack closed it)."""
        request = buffer_pb2.AckRequest(lease_id=lease_id, trainer_version=trainer_version)
        try:
            return self._call("Ack", request, f"Ack {lease_id}").acked
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                raise
            return None

    def extend(self, lease_ids: list[str], consumed: bool = False, trainer_version: int | None = None) -> list[str]:
        """Push back the deadline of open leases (buffer.lease_timeout_s from now), marking them consumed
        (trained on) if asked; returns the ids the buffer no longer holds."""
        request = buffer_pb2.ExtendLeaseRequest(
            lease_ids=lease_ids, lease_timeout_s=self.config.lease_timeout_s, consumed=consumed,
            trainer_version=trainer_version,
        )
        return list(self._call("ExtendLease", request, f"ExtendLease of {len(lease_ids)} lease(s)").missing)

    def set_version(self, version: int) -> int:
        """Tell the buffer the trainer's weight version; returns samples it dropped as stale."""
        return self._call("SetVersion", buffer_pb2.SetVersionRequest(version=version), "SetVersion").dropped

    def trainer_version(self) -> int:
        """The trainer version the buffer knows (it outlives a trainer's restart)."""
        return self.stats().trainer_version

    def stats(self) -> buffer_pb2.StatsResponse:
        return self._call("Stats", buffer_pb2.StatsRequest(), "Stats")

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
