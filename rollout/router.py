"""The rollout router: `relayrl serve rollout` with `router.decode` set serves Rollout in front of decode workers.

Each Generate goes to one decode worker (rollout/pd_decode.py; the design is in rollout/pd_prefill.py):
the worker its routing key went to before while that worker lives (affinity keeps a key's KV on one
worker), else the least loaded live worker (running + waiting sequences, counting the calls this router
has in flight to it, then free KV blocks). Loads come from DecodeWorker.GetLoad every `poll_s`; a worker that
fails a poll or a forwarded call (UNAVAILABLE) is dropped from routing at once and taken back when a poll
succeeds again. A forwarded call that fails UNAVAILABLE (its worker died) is re-run on another worker: the
router gives every request without a seed one of its own, so the re-run samples the same tokens (under the
same weights), and a stream skips the tokens its client already has. Sessions and ComputeLogprobs are not
routed here (UNIMPLEMENTED): point session clients at a decode worker.
"""

import asyncio
import contextlib
import logging
import random
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
from prometheus_client import Gauge
from pydantic import Field

from protos import kv_pb2, kv_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.config import ClientConfig, Strict

log = logging.getLogger(__name__)
LIVE_WORKERS = Gauge("relayrl_router_live_decode_workers", "Decode workers the router sends to")
_AFFINITY_KEYS = 100_000  # routing keys remembered (least recently used forgotten first)


class RouterSettings(Strict):
    """Prefill/decode disaggregation behind the rollout service (None in the rollout config: one worker does both)."""

    decode: list[str] = Field(min_length=1, description="host:port of each decode worker (`relayrl serve decode`).")
    client: ClientConfig = Field(default_factory=ClientConfig, description="How to reach the decode workers.")
    poll_s: float = Field(1.0, gt=0, description="How often each decode worker's load (and life) is read.")
    max_attempts: int = Field(3, gt=0, description="Workers a request is tried on before it fails UNAVAILABLE.")


@dataclass
class Worker:
    address: str
    rollout: rollout_pb2_grpc.RolloutStub
    decode: kv_pb2_grpc.DecodeWorkerStub
    alive: bool = False
    load: kv_pb2.GetLoadResponse = field(default_factory=kv_pb2.GetLoadResponse)
    in_flight: int = 0

    def busy(self) -> tuple[int, int]:
        return self.load.running + self.load.waiting + self.in_flight, -self.load.free_blocks


class Router:
    def __init__(self, settings: RouterSettings, channels: list[grpc.aio.Channel]):
        self.settings = settings
        self.workers = [Worker(address, rollout_pb2_grpc.RolloutStub(channel), kv_pb2_grpc.DecodeWorkerStub(channel))
                        for address, channel in zip(settings.decode, channels)]
        self.affinity: OrderedDict[str, Worker] = OrderedDict()
        self.sessions: OrderedDict[str, Worker] = OrderedDict()  # open session id -> the worker that holds it
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        self._poller = asyncio.ensure_future(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll(worker) for worker in self.workers))
        LIVE_WORKERS.set(sum(worker.alive for worker in self.workers))

    def choose(self, routing_key: str, exclude: set[str]) -> Worker | None:
        """The worker for a request (None when no live worker is left outside `exclude`)."""
        sticky = self.affinity.get(routing_key) if routing_key else None
        if sticky is not None and sticky.alive and sticky.address not in exclude:
            self.affinity.move_to_end(routing_key)
            return sticky
        live = [worker for worker in self.workers if worker.alive and worker.address not in exclude]
        if not live:
            return None
        worker = min(live, key=Worker.busy)
        if routing_key:
            self.affinity[routing_key] = worker
            if len(self.affinity) > _AFFINITY_KEYS:
                self.affinity.popitem(last=False)
        return worker

    def drop(self, worker: Worker, why: str) -> None:
        if worker.alive:
            log.warning("decode worker %s dropped from routing: %s", worker.address, why)
        worker.alive = False
        LIVE_WORKERS.set(sum(w.alive for w in self.workers))

    async def _poll(self, worker: Worker) -> None:
        try:
            worker.load = await worker.decode.GetLoad(kv_pb2.GetLoadRequest(), timeout=self.settings.poll_s)
        except grpc.aio.AioRpcError as exc:
            self.drop(worker, f"GetLoad: {exc.code().name}")
            return
        if not worker.alive:
            log.info("decode worker %s routed to", worker.address)
        worker.alive = True

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.settings.poll_s)


class RouterServicer(rollout_pb2_grpc.RolloutServicer):
    """Rollout's RPCs, routed: Generate / GenerateStream / GenerateMany by load and routing key (re-run elsewhere when
    a worker dies), a session's RPCs to the worker that opened it (its KV lives there: a session cannot move, so
    its worker's death is UNAVAILABLE for it), Abort to every worker, the others to any live one."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request: rollout_pb2.GenerateRequest, context) -> rollout_pb2.GenerateResponse:
        request = _seeded(request)
        tried: set[str] = set()
        while True:
            worker = await self._choose(request, tried, context)
            worker.in_flight += 1
            try:
                return await worker.rollout.Generate(request)
            except grpc.aio.AioRpcError as exc:
                await self._failed(worker, exc, context)
            finally:
                worker.in_flight -= 1

    async def GenerateMany(self, request: rollout_pb2.GenerateManyRequest, context) -> rollout_pb2.GenerateManyResponse:
        responses = await asyncio.gather(*(self.Generate(one, context) for one in request.requests))
        return rollout_pb2.GenerateManyResponse(responses=responses)

    async def GenerateStream(self, request: rollout_pb2.GenerateRequest, context):
        request = _seeded(request)
        sent: dict[int, int] = {}  # completion index -> tokens the client has
        tried: set[str] = set()
        while True:
            worker = await self._choose(request, tried, context)
            worker.in_flight += 1
            seen: dict[int, int] = {}
            try:
                async for chunk in worker.rollout.GenerateStream(request):
                    skip = max(0, sent.get(chunk.index, 0) - seen.get(chunk.index, 0))
                    seen[chunk.index] = seen.get(chunk.index, 0) + chunk.token_ids.length
                    if skip:  # a re-run: these tokens reached the client from the worker that died
                        if skip >= chunk.token_ids.length and chunk.finish_reason == rollout_pb2.FINISH_REASON_NONE:
                            continue
                        chunk = _tail(chunk, skip)
                    sent[chunk.index] = seen[chunk.index]
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                await self._failed(worker, exc, context)
            finally:
                worker.in_flight -= 1

    async def Abort(self, request: rollout_pb2.AbortRequest, context) -> rollout_pb2.AbortResponse:
        live = [worker for worker in self.router.workers if worker.alive]
        replies = await asyncio.gather(*(worker.rollout.Abort(request, timeout=10) for worker in live),
                                       return_exceptions=True)
        return rollout_pb2.AbortResponse(found=any(getattr(reply, "found", False) for reply in replies))

    async def GetWeightVersion(self, request, context) -> rollout_pb2.GetWeightVersionResponse:
        worker = await self._choose(rollout_pb2.GenerateRequest(), set(), context)
        return await worker.rollout.GetWeightVersion(request)

    async def GetModelInfo(self, request, context) -> rollout_pb2.GetModelInfoResponse:
        worker = await self._choose(rollout_pb2.GenerateRequest(), set(), context)
        return await worker.rollout.GetModelInfo(request)

    async def ComputeLogprobs(self, request, context) -> rollout_pb2.ComputeLogprobsResponse:
        worker = await self._choose(rollout_pb2.GenerateRequest(), set(), context)
        return await self._once(worker, worker.rollout.ComputeLogprobs(request), context)

    async def OpenSession(self, request: rollout_pb2.OpenSessionRequest, context) -> rollout_pb2.OpenSessionResponse:
        opening = rollout_pb2.OpenSessionRequest()
        opening.CopyFrom(request)
        opening.session_id = request.session_id or uuid.uuid4().hex
        worker = await self._choose(rollout_pb2.GenerateRequest(), set(), context)
        reply = await self._once(worker, worker.rollout.OpenSession(opening), context)
        self.router.sessions[opening.session_id] = worker
        if len(self.router.sessions) > _AFFINITY_KEYS:  # sessions that expired on their worker, oldest first
            self.router.sessions.popitem(last=False)
        return reply

    async def AppendToSession(self, request, context) -> rollout_pb2.AppendToSessionResponse:
        worker = await self._session_worker(request.session_id, context)
        return await self._once(worker, worker.rollout.AppendToSession(request), context)

    async def GenerateInSession(self, request, context):
        worker = await self._session_worker(request.session_id, context)
        try:
            async for chunk in worker.rollout.GenerateInSession(request):
                yield chunk
        except grpc.aio.AioRpcError as exc:
            await self._lost(worker, exc, context)

    async def CloseSession(self, request, context) -> rollout_pb2.CloseSessionResponse:
        worker = await self._session_worker(request.session_id, context)
        reply = await self._once(worker, worker.rollout.CloseSession(request), context)
        self.router.sessions.pop(request.session_id, None)
        return reply

    async def _session_worker(self, session_id: str, context) -> Worker:
        worker = self.router.sessions.get(session_id)
        if worker is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id!r} is not open (never opened through "
                                "this router, or closed)")
        self.router.sessions.move_to_end(session_id)
        return worker

    async def _once(self, worker: Worker, call, context):
        """A call that cannot be re-run elsewhere: its worker's answer, or UNAVAILABLE when the worker is gone."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            await self._lost(worker, exc, context)

    async def _lost(self, worker: Worker, exc: grpc.aio.AioRpcError, context) -> None:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.router.drop(worker, f"{exc.code().name}: {exc.details()}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {worker.address} is gone: "
                                f"{exc.details()}")
        await context.abort(exc.code(), exc.details())

    async def _choose(self, request: rollout_pb2.GenerateRequest, tried: set[str], context):
        if len(tried) >= self.router.settings.max_attempts:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode workers {sorted(tried)} failed this request")
        worker = self.router.choose(request.routing_key, tried)
        if worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no live decode worker" +
                                (f" besides {sorted(tried)}, which failed this request" if tried else ""))
        tried.add(worker.address)
        return worker

    async def _failed(self, worker: Worker, exc: grpc.aio.AioRpcError, context) -> None:
        """A worker that is gone is dropped (the caller tries another); any other status is the request's own."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            await context.abort(exc.code(), exc.details())
        self.router.drop(worker, f"{exc.code().name}: {exc.details()}")


def _seeded(request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateRequest:
    """The request with a sampling seed (its own, or one drawn here), so a re-run samples the same tokens."""
    if request.params.HasField("seed"):
        return request
    seeded = rollout_pb2.GenerateRequest()
    seeded.CopyFrom(request)
    seeded.params.seed = random.getrandbits(64)
    return seeded


def _tail(chunk: rollout_pb2.GenerateChunk, skip: int) -> rollout_pb2.GenerateChunk:
    """The chunk without its first `skip` tokens (text dropped: it cannot be cut by token here)."""
    from protos.codec import decode_array, encode_array

    out = rollout_pb2.GenerateChunk(request_id=chunk.request_id, index=chunk.index, finish_reason=chunk.finish_reason)
    out.token_ids.CopyFrom(encode_array(decode_array(chunk.token_ids, expect="int32")[skip:], "int32"))
    if chunk.logprobs.length:
        out.logprobs.CopyFrom(encode_array(decode_array(chunk.logprobs, expect="float32")[skip:], "float32"))
    else:
        out.logprobs.CopyFrom(encode_array([], "float32"))
    out.weight_versions.CopyFrom(encode_array(decode_array(chunk.weight_versions, expect="int64")[skip:], "int64"))
    return out


async def serve_router(config) -> None:
    """Serve Rollout in front of `config.router.decode` until SIGTERM (no engine, no model loaded here)."""
    from rollout.service import SERVICE_NAME
    from services.client import connect
    from services.runtime import serve as serve_forever

    settings = config.router
    channels = [connect(address, settings.client) for address in settings.decode]
    router = Router(settings, channels)
    await router.poll()
    router.start()

    async def on_stop() -> None:
        await router.stop()
        for channel in channels:
            await channel.close()

    await serve_forever("rollout-router", [(rollout_pb2_grpc.add_RolloutServicer_to_server, RouterServicer(router),
                                            SERVICE_NAME)], config.server, on_stop)
