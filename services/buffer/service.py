"""The Buffer gRPC service: proto <-> ReplayBuffer, statuses for every refusal, and serve()."""

import asyncio
import logging
import math
import time

import grpc
from pydantic import Field

from protos import buffer_pb2, buffer_pb2_grpc
from services.buffer.buffer import ReplayBuffer
from services.buffer.config import BufferConfig
from services.buffer.entries import GroupSizeConflict, LeaseNotFound, Policy, PullSpec
from services.buffer.results import BufferFull, LeasedBatch, StagedPut
from services.buffer.wire import SERVICE_NAME, PutPayload, add_buffer_to_server, require
from services.config import ServerConfig
from services.runtime import serve as run_server
from services.runtime import setup_logging
from services.tracing import enabled as tracing_enabled
from services.tracing import payload_traceparent, record_span

log = logging.getLogger(__name__)

_POLICIES = {
    buffer_pb2.POLICY_UNSPECIFIED: Policy.FIFO,
    buffer_pb2.POLICY_FIFO: Policy.FIFO,
    buffer_pb2.POLICY_UNIFORM: Policy.UNIFORM,
}


class Config(BufferConfig):
    """`relayrl serve buffer`: the buffer's settings plus how it listens."""

    server: ServerConfig = Field(default_factory=ServerConfig, description="Address, limits, TLS, auth.")


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    """Registered by wire.add_buffer_to_server: requests may arrive Undecodable (see wire.py), and
    Pull yields LeasedBatch objects that wire.encode_batch puts on the wire."""

    def __init__(self, buffer: ReplayBuffer, max_message_bytes: int):
        self.buffer = buffer
        self.max_message_bytes = max_message_bytes
        self._traced_leases: dict[str, list[str]] = {}  # lease id -> its traced samples' contexts (tracing on)

    async def Put(self, request: PutPayload, context: grpc.aio.ServicerContext) -> buffer_pb2.PutResponse:
        staged = await self._stage(require(request), context)
        result = await self.buffer.commit_put(staged)
        return buffer_pb2.PutResponse(accepted=result.accepted, duplicates=result.duplicates)

    async def PutStream(self, request_iterator, context: grpc.aio.ServicerContext) -> buffer_pb2.PutResponse:
        # Each message is appended as it arrives and made durable in the background (group
        # commit), so the stream is not held to one fsync per message; the reply waits for all.
        durable, accepted, duplicates = [], 0, 0
        async for request in request_iterator:
            staged = await self._stage(require(request), context)
            durable.append(self.buffer.finish_put(staged))
            accepted, duplicates = accepted + staged.result.accepted, duplicates + staged.result.duplicates
        await asyncio.shield(asyncio.gather(*durable))
        return buffer_pb2.PutResponse(accepted=accepted, duplicates=duplicates)

    async def _stage(self, request: PutPayload, context: grpc.aio.ServicerContext) -> StagedPut:
        try:
            return await self.buffer.stage_put(request.samples)
        except BufferFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except GroupSizeConflict as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def Pull(self, request: buffer_pb2.PullRequest, context: grpc.aio.ServicerContext):
        request = require(request)
        spec = await self._pull_spec(request, context)
        if request.HasField("trainer_version"):
            await self.buffer.set_version(request.trainer_version)
        log.debug("Pull by %r: %s", request.consumer, spec)
        max_unacked = request.max_unacked or self.buffer.config.max_unacked
        sent, unacked = 0, []
        while request.max_batches == 0 or sent < request.max_batches:
            unacked = await self.buffer.wait_for_acks(unacked, max_unacked)
            leasing_ns = time.time_ns()
            batch: LeasedBatch = await self.buffer.lease_batch(spec)
            if tracing_enabled():
                self._trace_lease(batch, leasing_ns)
            size = sum(len(payload) for payload in batch.payloads)
            if size > self.max_message_bytes:
                self.buffer.release(batch.lease_id)
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a batch of {len(batch.payloads)} samples holds {size} bytes, over the server's "
                    f"max_message_bytes {self.max_message_bytes}: pull smaller batches",
                )
            unacked.append(batch.lease_id)
            yield batch
            sent += 1

    async def _pull_spec(self, request: buffer_pb2.PullRequest, context: grpc.aio.ServicerContext) -> PullSpec:
        problem = None
        if request.batch_size == 0:
            problem = "batch_size: must be > 0"
        elif request.batch_size > self.buffer.config.capacity:
            problem = f"batch_size: {request.batch_size} exceeds the buffer's capacity {self.buffer.config.capacity}"
        elif not math.isfinite(request.lease_timeout_s) or request.lease_timeout_s < 0:
            problem = f"lease_timeout_s: must be a finite number >= 0, got {request.lease_timeout_s}"
        elif request.policy not in _POLICIES:
            problem = f"policy: unknown value {request.policy}"
        elif request.HasField("trainer_version") and request.trainer_version < 0:
            problem = f"trainer_version: must be >= 0, got {request.trainer_version}"
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        config = self.buffer.config
        return PullSpec(
            batch_size=request.batch_size,
            whole_groups=not request.allow_partial_groups,
            policy=_POLICIES[request.policy],
            max_reuse=request.max_reuse or config.max_reuse,
            lease_timeout_s=request.lease_timeout_s or config.lease_timeout_s,
            consumer=request.consumer,
        )

    async def Ack(self, request: buffer_pb2.AckRequest, context: grpc.aio.ServicerContext) -> buffer_pb2.AckResponse:
        request = require(request)
        if not request.lease_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_id: must not be empty")
        version = request.trainer_version if request.HasField("trainer_version") else None
        if version is not None and version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"trainer_version: must be >= 0, got {version}")
        acking_ns = time.time_ns()
        try:
            acked = await self.buffer.ack(request.lease_id, version)
        except LeaseNotFound:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"lease {request.lease_id!r} is not open: it expired or was issued by an earlier buffer process "
                "(its samples were or will be delivered again), was acked already, or never existed",
            )
        for traceparent in self._traced_leases.pop(request.lease_id, ()):
            record_span("buffer.ack", traceparent, acking_ns, lease_id=request.lease_id)
        return buffer_pb2.AckResponse(acked=acked)

    def _trace_lease(self, batch: LeasedBatch, leasing_ns: int) -> None:
        """Each traced sample's lease as a span of its trace; its ack is one too, when it comes."""
        traced = [tp for tp in map(payload_traceparent, batch.payloads) if tp is not None]
        for traceparent in traced:
            record_span("buffer.lease", traceparent, leasing_ns, lease_id=batch.lease_id,
                        trainer_version=batch.trainer_version)
        if traced:
            while len(self._traced_leases) >= 4096:  # leases never acked (expired, redelivered) are forgotten
                self._traced_leases.pop(next(iter(self._traced_leases)))
            self._traced_leases[batch.lease_id] = traced

    async def ExtendLease(
        self, request: buffer_pb2.ExtendLeaseRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.ExtendLeaseResponse:
        request = require(request)
        version = request.trainer_version if request.HasField("trainer_version") else None
        if not math.isfinite(request.lease_timeout_s) or request.lease_timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"lease_timeout_s: must be a finite number >= 0, got {request.lease_timeout_s}")
        if version is not None and version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"trainer_version: must be >= 0, got {version}")
        if any(not lease_id for lease_id in request.lease_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_ids: must not hold an empty id")
        extended, missing = await self.buffer.extend_leases(
            list(request.lease_ids), request.lease_timeout_s, request.consumed, version)
        return buffer_pb2.ExtendLeaseResponse(extended=extended, missing=missing)

    async def SetVersion(
        self, request: buffer_pb2.SetVersionRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.SetVersionResponse:
        request = require(request)
        if request.version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version: must be >= 0, got {request.version}")
        return buffer_pb2.SetVersionResponse(dropped=await self.buffer.set_version(request.version))

    async def Stats(self, request: buffer_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> buffer_pb2.StatsResponse:
        require(request)
        stats = self.buffer.stats()
        return buffer_pb2.StatsResponse(
            pending=stats.pending + stats.staged,
            leased=stats.leased,
            consumed=stats.consumed,
            acked=stats.acked,
            dropped=stats.dropped,
            capacity=stats.capacity,
            accepted=stats.accepted,
            trainer_version=stats.trainer_version,
            max_staleness=-1 if stats.max_staleness is None else stats.max_staleness,
            redelivered=stats.redelivered,
            duplicates=stats.duplicates,
        )


def registration(buffer: ReplayBuffer, server: ServerConfig | None = None):
    """What create_server needs to serve `buffer` under the `server` settings."""
    max_message_bytes = (server or ServerConfig()).max_message_bytes
    return (add_buffer_to_server, BufferServicer(buffer, max_message_bytes), SERVICE_NAME)


async def serve(config: Config) -> None:
    """Recover the buffer from its log, serve until SIGTERM, then make everything durable."""
    setup_logging("buffer", config.server.log_level)
    buffer = ReplayBuffer.open(config)
    await buffer.start()
    await run_server("buffer", [registration(buffer, config.server)], config.server, on_stop=buffer.close)
