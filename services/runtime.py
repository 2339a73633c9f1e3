"""serve(): run a relayrl service until SIGTERM/SIGINT, then stop gracefully."""

import asyncio
import json
import logging
import math
import os
import pathlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

from services.config import ServerConfig
from services.metrics import start_metrics_endpoint
from services.server import Registration, create_server
from services.stage_reports import start_stage_reports
from services.tracing import setup_tracing

log = logging.getLogger("relayrl")


def setup_logging(name: str, level: str = "INFO") -> None:
    """Log lines carry the service name, so interleaved logs of a local cluster stay readable."""
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


class Sparse:
    """The level for a per-step event: INFO the first time and then at most once every `interval_s`, DEBUG
    otherwise (a weight version a step is thousands of INFO lines an hour)."""

    def __init__(self, interval_s: float = 30.0) -> None:
        self.interval_s, self._last = interval_s, -math.inf

    def level(self) -> int:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return logging.DEBUG
        self._last = now
        return logging.INFO


def write_port_file(path: str, **info: object) -> None:
    """Write {"port": ..., ...} atomically, so a reader never sees half a file."""
    target = pathlib.Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)


async def serve(
    name: str,
    services: Sequence[Registration],
    config: ServerConfig,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    stage_report: Callable[[], dict[str, float]] | None = None,
    peak_flops: Callable[[], float] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; then refuse new calls, let in-flight ones finish within
    `config.grace_s`, and run `on_stop`. `stage_report`: the service's interval report (services/stage_reports.py),
    written every config.stage_reports.interval_s when config.stage_reports.dir is set; `peak_flops` its device's."""
    setup_logging(name, config.log_level)
    setup_tracing(name, config.tracing)
    reports = start_stage_reports(name, config.stage_reports, stage_report, peak_flops)
    server, port = await create_server(config.address, services, config)
    host = config.address.rsplit(":", 1)[0]
    # /metrics on the gRPC server's own host: where a service on a node's address is reached, it is scraped too
    metrics_port = (start_metrics_endpoint(config.metrics_port, host.strip("[]") or "127.0.0.1")
                    if config.metrics_port is not None else None)
    await server.start()
    log.info("%s listening on %s:%d%s", name, host, port,
             f" (metrics on :{metrics_port}/metrics)" if metrics_port is not None else "")
    if config.port_file:
        write_port_file(config.port_file, port=port, metrics_port=metrics_port, pid=os.getpid())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s stopping: %.1fs grace for in-flight calls", name, config.grace_s)
    await server.health.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    if reports is not None:
        reports.stop()
    if on_stop is not None:
        await on_stop()
    log.info("%s stopped", name)
