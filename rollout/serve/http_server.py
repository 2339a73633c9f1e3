"""An HTTP app (FastAPI) served by uvicorn inside a gRPC service's asyncio loop: the OpenAI-compatible endpoint of a
rollout replica (rollout/serve/openai_api.py) and of the router (rollout/router/openai_proxy.py)."""

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the service's runtime owns SIGTERM / SIGINT
        yield


@dataclass
class OpenAIServer:
    """The endpoint being served; stop() lets open requests finish (up to grace_s), then closes it."""

    server: uvicorn.Server
    task: asyncio.Task
    port: int

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http(app, host: str, port: int, grace_s: float) -> OpenAIServer:
    """Serve `app` on host:port (0: a free port) in this loop; returns once it listens (raises if it cannot bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=grace_s)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return OpenAIServer(server, task, sock.getsockname()[1])
