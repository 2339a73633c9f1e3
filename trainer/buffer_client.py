"""The trainer's client of the replay buffer: pull leased batches, ack them after the step that used them."""

import logging
import time
from dataclasses import dataclass

import grpc

from protos import buffer_pb2, buffer_pb2_grpc
from protos.sample import Sample
from services.client import connect_sync
from trainer.config import BufferClientConfig

log = logging.getLogger(__name__)

# Worth another try within max_wait_s: no batch ready yet, or the buffer is restarting.
_RETRYABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
_RETRY_PAUSE_S = 0.2


@dataclass
class LeasedBatch:
    """Samples under a lease: redelivered by the buffer unless acked in time."""

    lease_id: str
    samples: list[Sample]
    trainer_version: int


class BufferClient:
    """A blocking gRPC client of relayrl.buffer.v1.Buffer; every call has a deadline."""

    def __init__(self, config: BufferClientConfig, call_timeout_s: float = 30.0) -> None:
        if config.address is None:
            raise ValueError("buffer.address: the trainer needs the buffer's host:port")
        self.config = config
        self.call_timeout_s = call_timeout_s
        self._channel = connect_sync(config.address, config.client)
        self._stub = buffer_pb2_grpc.BufferStub(self._channel)

    def pull(self, batch_size: int) -> LeasedBatch:
        """Wait (up to buffer.max_wait_s) for one leased batch of `batch_size` samples."""
        request = buffer_pb2.PullRequest(
            batch_size=batch_size,
            allow_partial_groups=self.config.allow_partial_groups,
            max_batches=1,
            lease_timeout_s=self.config.lease_timeout_s,
            consumer=self.config.consumer,
        )
        deadline = time.monotonic() + self.config.max_wait_s
        while True:
            try:
                for batch in self._stub.Pull(request, timeout=self.config.pull_timeout_s):
                    return LeasedBatch(
                        lease_id=batch.lease_id,
                        samples=[Sample.from_proto(msg) for msg in batch.samples],
                        trainer_version=batch.trainer_version,
                    )
                outcome = "stream ended without a batch"
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                outcome = exc.code().name
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no batch of {batch_size} samples from the buffer at {self.config.address} "
                    f"within {self.config.max_wait_s:.0f}s (last: {outcome})"
                )
            log.info("waiting for a batch from the buffer (%s)", outcome)
            time.sleep(_RETRY_PAUSE_S)

    def ack(self, lease_id: str, trainer_version: int) -> int:
        """Acknowledge a lease after the optimizer step that used it; returns samples acked."""
        reply = self._stub.Ack(
            buffer_pb2.AckRequest(lease_id=lease_id, trainer_version=trainer_version), timeout=self.call_timeout_s
        )
        return reply.acked

    def set_version(self, version: int) -> int:
        """Tell the buffer the trainer's weight version; returns samples it dropped as stale."""
        reply = self._stub.SetVersion(buffer_pb2.SetVersionRequest(version=version), timeout=self.call_timeout_s)
        return reply.dropped

    def stats(self) -> buffer_pb2.StatsResponse:
        return self._stub.Stats(buffer_pb2.StatsRequest(), timeout=self.call_timeout_s)

    def close(self) -> None:
        self._channel.close()
