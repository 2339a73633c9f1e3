"""The router's OpenAI-compatible endpoint: each HTTP call forwarded, as it is, to one replica's own endpoint.

`openai:` set in the router's config serves it; each replica serves its own (`openai:` with port 0 on the
replicas: the port they bound comes back in their GetLoad). A call with a session key (X-Session-Id, or the bearer
key when `session_by_key`) and `/v1/sessions/{id}/...` go to the replica that took the session's first call
(its KV and turns live there); a session whose replica is gone answers 503 naming it. Any other call goes to the
least loaded replica, and to another one if its replica cannot be reached before answering (nothing was sent).
Streams (server-sent events) pass through as they come.
"""

import logging
from collections import OrderedDict

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.router.router import _AFFINITY_KEYS, Router, Worker
from rollout.serve.http_server import OpenAIServer, start_http
from rollout.serve.openai_schema import OpenAISettings
from rollout.serve.openai_sessions import session_key

log = logging.getLogger(__name__)
_PASSED_HEADERS = ("content-type", "authorization", "x-session-id")
_RETURNED_HEADERS = ("content-type", "retry-after")


class OpenAIRouter:
    """Forwards HTTP calls to the replicas' endpoints, sessions sticky."""

    def __init__(self, router: Router, settings: OpenAISettings):
        self.router, self.settings = router, settings
        self.sessions: OrderedDict[str, Worker] = OrderedDict()  # session key -> the replica that holds it
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def forward(self, path: str, request: Request):
        session = self._session_key(path, request)
        holder = self.sessions.get(session) if session else None
        if holder is not None and (holder.address not in self.router.workers or not holder.alive):
            self.sessions.pop(session, None)
            return _error(503, f"session {session!r}: its replica {holder.address} is gone (died or removed), and "
                          "its turns with it: start a new session")
        body = await request.body()
        tried: set[str] = set()
        while True:
            worker = holder or self._choose(tried)
            if worker is None:
                return _error(503, "no routed replica serves the OpenAI endpoint" +
                              (f" besides {sorted(tried)}, which could not be reached" if tried else ""))
            tried.add(worker.address)
            host = worker.address.rsplit(":", 1)[0]
            outgoing = self.client.build_request(
                request.method, f"http://{host}:{worker.load.openai_port}/{path}", content=body,
                params=request.query_params,
                headers={k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS})
            worker.take(1)
            try:
                answer = await self.client.send(outgoing, stream=True)
            except httpx.TransportError as exc:
                self._done(worker)
                self.router.drop(worker, f"OpenAI endpoint: {type(exc).__name__}")
                if holder is not None:
                    return _error(503, f"session {session!r}: its replica {worker.address} is gone: {exc}")
                continue
            if session and answer.status_code < 400:
                self._pin(session, worker)
            return StreamingResponse(self._relay(answer, worker), status_code=answer.status_code,
                                     headers={k: v for k, v in answer.headers.items()
                                              if k.lower() in _RETURNED_HEADERS})

    async def close(self) -> None:
        await self.client.aclose()

    async def _relay(self, answer: httpx.Response, worker: Worker):
        try:
            async for piece in answer.aiter_raw():
                yield piece
        finally:
            await answer.aclose()
            self._done(worker)

    def _choose(self, tried: set[str]) -> Worker | None:
        without = {w.address for w in self.router.workers.values() if not w.load.openai_port}
        return self.router.choose("", tried | without)

    def _done(self, worker: Worker) -> None:
        worker.give_back(1)
        self.router.notify()

    def _session_key(self, path: str, request: Request) -> str | None:
        parts = path.split("/")
        if len(parts) >= 3 and parts[:2] == ["v1", "sessions"]:
            return parts[2]
        return session_key(request.headers, self.settings.session_by_key)

    def _pin(self, session: str, worker: Worker) -> None:
        self.sessions[session] = worker
        self.sessions.move_to_end(session)
        if len(self.sessions) > _AFFINITY_KEYS:
            self.sessions.popitem(last=False)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "service_unavailable", "param": None,
                                   "code": "unavailable"}}, status_code=status)


async def serve_router_openai(settings: OpenAISettings, router: Router) -> tuple[OpenAIServer, OpenAIRouter]:
    """Start the forwarding endpoint in this loop; returns once it listens."""
    forwarder = OpenAIRouter(router, settings)
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        return await forwarder.forward(path, request)

    server = await start_http(app, settings.host, settings.port, settings.grace_s)
    log.info("OpenAI-compatible endpoint (routed) on http://%s:%d/v1", settings.host, server.port)
    return server, forwarder
