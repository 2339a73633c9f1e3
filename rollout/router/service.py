"""The rollout router's RPCs: Rollout routed over the workers of rollout/router/router.py, and the Replicas control
(its OpenAI-compatible endpoint, when `openai:` is set, is rollout/router/openai_proxy.py).

Generate / GenerateStream / GenerateMany go by load and routing key; a call whose worker dies (UNAVAILABLE) is
re-run on another: the router gives every request without a seed one of its own, so the re-run samples the same
tokens (under the same weights), and a stream skips the tokens its client already has. GetWeightVersion,
GetModelInfo and ComputeLogprobs are re-run on another worker the same way.

Sessions are sticky: OpenSession goes to the least loaded worker and every later call of the session to that
worker (its KV lives there; a session cannot move). A session id the router makes (the request named none) ends
in `@HOST:PORT` of its replica, so its calls find the replica even after the router restarted; a client's own id
the router does not know (it restarted) is looked for on each live worker in turn (a worker that does not hold
it answers NOT_FOUND, which changes nothing there). A session whose replica died or left is UNAVAILABLE, saying so.
"""

import asyncio
import random
import uuid

import grpc

from protos import rollout_pb2, rollout_pb2_grpc, router_pb2, router_pb2_grpc
from rollout.router.router import _AFFINITY_KEYS, Router, State, Worker

_SESSION_MARK = "@"


class RouterServicer(rollout_pb2_grpc.RolloutServicer):
    """Rollout's RPCs, routed: generation by load and routing key (re-run elsewhere when a worker dies), a session's
    RPCs to the worker that holds it, Abort to every worker, the others to any routed one."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request: rollout_pb2.GenerateRequest, context) -> rollout_pb2.GenerateResponse:
        request = _seeded(request)
        tried: set[str] = set()
        while True:
            worker = await self._choose(request, tried, context)
            worker.take(request.params.n or 1)
            try:
                return await worker.rollout.Generate(request)
            except grpc.aio.AioRpcError as exc:
                await self._failed(worker, exc, context)
            finally:
                self._done(worker, request.params.n or 1)

    async def GenerateMany(self, request: rollout_pb2.GenerateManyRequest, context) -> rollout_pb2.GenerateManyResponse:
        responses = await asyncio.gather(*(self.Generate(one, context) for one in request.requests))
        return rollout_pb2.GenerateManyResponse(responses=responses)

    async def GenerateStream(self, request: rollout_pb2.GenerateRequest, context):
        request = _seeded(request)
        sent: dict[int, int] = {}  # completion index -> tokens the client has
        tried: set[str] = set()
        while True:
            worker = await self._choose(request, tried, context)
            worker.take(request.params.n or 1)
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
                self._done(worker, request.params.n or 1)

    async def Abort(self, request: rollout_pb2.AbortRequest, context) -> rollout_pb2.AbortResponse:
        live = [worker for worker in self.router.workers.values() if worker.alive]
        replies = await asyncio.gather(*(worker.rollout.Abort(request, timeout=10) for worker in live),
                                       return_exceptions=True)
        return rollout_pb2.AbortResponse(found=any(getattr(reply, "found", False) for reply in replies))

    async def GetWeightVersion(self, request, context) -> rollout_pb2.GetWeightVersionResponse:
        return await self._anywhere(lambda stub: stub.GetWeightVersion(request), context, counted=False)

    async def GetModelInfo(self, request, context) -> rollout_pb2.GetModelInfoResponse:
        return await self._anywhere(lambda stub: stub.GetModelInfo(request), context, counted=False)

    async def GetLoad(self, request, context) -> rollout_pb2.GetLoadResponse:
        """The routed workers' loads summed; the weight version the routed workers serve (their highest)."""
        total = rollout_pb2.GetLoadResponse(weight_version=self.router.routed_version() or 0)
        for worker in self.router.workers.values():
            if worker.routed:
                for name in ("free_blocks", "num_blocks", "running", "waiting", "sessions"):
                    setattr(total, name, getattr(total, name) + getattr(worker.load, name))
        return total

    async def ComputeLogprobs(self, request, context) -> rollout_pb2.ComputeLogprobsResponse:
        return await self._anywhere(lambda stub: stub.ComputeLogprobs(request), context, counted=True)

    # -- sessions ----------------------------------------------------------------------------------

    async def OpenSession(self, request: rollout_pb2.OpenSessionRequest, context) -> rollout_pb2.OpenSessionResponse:
        worker = await self._choose(rollout_pb2.GenerateRequest(), set(), context)
        opening = rollout_pb2.OpenSessionRequest()
        opening.CopyFrom(request)
        opening.session_id = request.session_id or f"{uuid.uuid4().hex}{_SESSION_MARK}{worker.address}"
        reply = await self._once(worker, worker.rollout.OpenSession(opening), context)
        self._pin(opening.session_id, worker)
        return reply

    async def AppendToSession(self, request, context) -> rollout_pb2.AppendToSessionResponse:
        return await self._session_call(request.session_id, lambda stub: stub.AppendToSession(request), context)

    async def CloseSession(self, request, context) -> rollout_pb2.CloseSessionResponse:
        try:
            return await self._session_call(request.session_id, lambda stub: stub.CloseSession(request), context)
        finally:
            if self.router.sessions.pop(request.session_id, None) is not None:
                self.router.notify()  # a draining replica may be waiting for its last session

    async def GenerateInSession(self, request, context):
        for worker in await self._session_workers(request.session_id, context):
            try:
                async for chunk in worker.rollout.GenerateInSession(request):
                    self._pin(request.session_id, worker)
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                if not self._look_further(request.session_id, exc):
                    await self._lost(worker, exc, context)
        await self._not_found(request.session_id, context)

    async def _session_call(self, session_id: str, call, context):
        for worker in await self._session_workers(session_id, context):
            try:
                reply = await call(worker.rollout)
            except grpc.aio.AioRpcError as exc:
                if self._look_further(session_id, exc):
                    continue
                await self._lost(worker, exc, context)
            self._pin(session_id, worker)
            return reply
        await self._not_found(session_id, context)

    async def _session_workers(self, session_id: str, context) -> list[Worker]:
        """The worker that holds the session, or (an id the router does not know) every live worker to look on."""
        worker = self.router.sessions.get(session_id)
        address = session_id.rpartition(_SESSION_MARK)[2] if _SESSION_MARK in session_id else None
        if worker is None and address is not None:
            worker = self.router.workers.get(address)
            if worker is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"session {session_id!r}: its replica {address} is "
                                    "not among this router's replicas (removed, or gone): the session is lost")
        if worker is None:
            return [w for w in self.router.workers.values() if w.alive]
        if worker.address not in self.router.workers or not worker.alive:
            self.router.sessions.pop(session_id, None)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"session {session_id!r}: its replica {worker.address} "
                                "is gone (died or removed), and its KV and turns with it: open a new session")
        return [worker]

    def _look_further(self, session_id: str, exc: grpc.aio.AioRpcError) -> bool:
        """NOT_FOUND for an id the router never pinned: another worker may hold it (the router restarted)."""
        return (exc.code() == grpc.StatusCode.NOT_FOUND and session_id not in self.router.sessions
                and _SESSION_MARK not in session_id)

    def _pin(self, session_id: str, worker: Worker) -> None:
        self.router.sessions[session_id] = worker
        self.router.sessions.move_to_end(session_id)
        if len(self.router.sessions) > _AFFINITY_KEYS:  # sessions that expired on their worker, oldest first
            self.router.sessions.popitem(last=False)

    @staticmethod
    async def _not_found(session_id: str, context) -> None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id!r} is not open on any live replica")

    # -- helpers -----------------------------------------------------------------------------------

    def _done(self, worker: Worker, sequences: int = 1) -> None:
        worker.give_back(sequences)
        self.router.notify()

    async def _anywhere(self, call, context, counted: bool):
        """A call any routed worker answers alike (a read, or logprobs under the served weights), re-run on another
        when its worker is gone, as Generate is: a replica that just died is still routed to until a poll or a
        failed call drops it, and its error must not reach the caller (an unhandled one would be UNKNOWN, which
        clients do not retry). `counted`: in the worker's load and in-flight count (work, not a read)."""
        tried: set[str] = set()
        while True:
            worker = await self._choose(rollout_pb2.GenerateRequest(), tried, context)
            if counted:
                worker.take(1)
            try:
                return await call(worker.rollout)
            except grpc.aio.AioRpcError as exc:
                await self._failed(worker, exc, context)
            finally:
                if counted:
                    self._done(worker)

    async def _once(self, worker: Worker, call, context):
        """A call that cannot be re-run elsewhere: its worker's answer, or UNAVAILABLE when the worker is gone."""
        worker.take(1)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            await self._lost(worker, exc, context)
        finally:
            self._done(worker)

    async def _lost(self, worker: Worker, exc: grpc.aio.AioRpcError, context) -> None:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.router.drop(worker, f"{exc.code().name}: {exc.details()}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {worker.address} is gone: {exc.details()}")
        await context.abort(exc.code(), exc.details())

    async def _choose(self, request: rollout_pb2.GenerateRequest, tried: set[str], context) -> Worker:
        if len(tried) >= self.router.settings.max_attempts:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"workers {sorted(tried)} failed this request")
        worker = self.router.choose(request.routing_key, tried)
        if worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no routed worker" +
                                (f" besides {sorted(tried)}, which failed this request" if tried else ""))
        tried.add(worker.address)
        return worker

    async def _failed(self, worker: Worker, exc: grpc.aio.AioRpcError, context) -> None:
        """A worker that is gone is dropped (the caller tries another); any other status is the request's own."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            await context.abort(exc.code(), exc.details())
        self.router.drop(worker, f"{exc.code().name}: {exc.details()}")


class ReplicasServicer(router_pb2_grpc.ReplicasServicer):
    """relayrl.router.v1.Replicas: add, drain and list the router's replicas."""

    def __init__(self, router: Router):
        self.router = router

    async def AddReplica(self, request: router_pb2.AddReplicaRequest, context) -> router_pb2.ReplicaInfo:
        if not request.address or ":" not in request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address: give HOST:PORT, got {request.address!r}")
        if not 0 <= request.wait_s <= 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s: within [0, 3600], got {request.wait_s}")
        return self._info(await self.router.add(request.address, request.wait_s))

    async def RemoveReplica(self, request: router_pb2.RemoveReplicaRequest,
                            context) -> router_pb2.RemoveReplicaResponse:
        if request.address not in self.router.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"address: {request.address!r} is not a replica of this "
                                f"router (it has {sorted(self.router.workers)})")
        if not 0 <= request.drain_timeout_s <= 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"drain_timeout_s: within [0, 3600], got {request.drain_timeout_s}")
        if len([w for w in self.router.workers.values() if w.state != State.DRAINING]) == 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.address} is the router's last "
                                "replica: add another before removing it")
        in_flight, sessions = await self.router.remove(
            request.address, request.drain_timeout_s or self.router.settings.drain_timeout_s)
        return router_pb2.RemoveReplicaResponse(drained=not (in_flight or sessions), in_flight=in_flight,
                                                sessions=sessions)

    async def ListReplicas(self, request, context) -> router_pb2.ListReplicasResponse:
        return router_pb2.ListReplicasResponse(replicas=[self._info(w) for w in self.router.workers.values()])

    def _info(self, worker: Worker) -> router_pb2.ReplicaInfo:
        return router_pb2.ReplicaInfo(
            address=worker.address, state=int(worker.state), alive=worker.alive,
            weight_version=worker.load.weight_version, in_flight=worker.in_flight, running=worker.load.running,
            waiting=worker.load.waiting, sessions=self.router.pinned(worker))


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
    if chunk.HasField("kv_version"):
        out.kv_version = chunk.kv_version
    out.routed_experts.CopyFrom(chunk.routed_experts)  # over the whole context: nothing to cut
    return out


async def serve_router(config) -> None:
    """Serve Rollout and Replicas in front of `config.router`'s workers until SIGTERM (no engine, no model here)."""
    from rollout.serve.wire import SERVICE_NAME
    from services.client import connect
    from services.runtime import serve as serve_forever

    settings = config.router
    router = Router(settings, lambda address: connect(address, settings.client))
    await router.poll()
    router.start()
    openai = None
    if config.openai is not None:  # forwarded to the replicas' own endpoints (rollout/router/openai_proxy.py)
        from rollout.router.openai_proxy import serve_router_openai

        openai = await serve_router_openai(config.openai, router)

    async def on_stop() -> None:
        if openai is not None:
            await openai[0].stop()
            await openai[1].close()
        await router.stop()

    await serve_forever("rollout-router", [
        (rollout_pb2_grpc.add_RolloutServicer_to_server, RouterServicer(router), SERVICE_NAME),
        (router_pb2_grpc.add_ReplicasServicer_to_server, ReplicasServicer(router), "relayrl.router.v1.Replicas"),
    ], config.server, on_stop)
