"""The local launcher: each service as its own process on this machine, found by address.

A service started here can be started again on the same address with the same settings
(`ServiceProcess.restart`): clients reconnect to it as they are, and a buffer recovers its log from
the same data_dir. deploy/local/supervisor.py decides when.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.record import service_registry
from services.client import connect_sync
from services.config import ClientConfig


class LaunchError(RuntimeError):
    """A service process failed to start; the message carries the tail of its log."""


@dataclass
class ServiceProcess:
    """A running service process, stopped by its own pid (never by name)."""

    name: str  # its name in the run (a rollout replica's is "rollout-2"); `kind` is what `relayrl serve` runs
    proc: subprocess.Popen
    address: str
    log_path: pathlib.Path
    metrics_port: int | None = None
    port_file: pathlib.Path = field(default=None)  # type: ignore[assignment]
    # How it was started, so restart() can start it again the same way.
    overrides: dict = field(default_factory=dict)
    config_path: str | os.PathLike | None = None
    env: Mapping[str, str] | None = None
    registry: pathlib.Path | None = None  # services.json of the run, rewritten on restart
    kind: str = ""  # "": the name
    client: ClientConfig | None = None  # how its health is checked (TLS, token); None = plain text

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        """None while it runs."""
        return self.proc.poll()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful), then SIGKILL after `timeout` seconds; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL now (crash tests)."""
        if self.alive():
            self.proc.kill()
        return self.proc.wait(30)

    def restart(self, timeout: float = 120.0) -> None:
        """Kill this process if it still runs, then start the service again on the same address.

        Raises LaunchError if it does not serve again within `timeout` (the port taken, a crash at start).
        """
        self.kill()
        fresh = start_service(self.kind or self.name, {**self.overrides, "server.address": self.address},
                              config_path=self.config_path, log_dir=self.log_path.parent, env=self.env,
                              timeout=timeout, registry=self.registry, label=self.name, client=self.client)
        self.proc, self.port_file, self.metrics_port = fresh.proc, fresh.port_file, fresh.metrics_port

    def log_tail(self, lines: int = 40) -> str:
        return tail_of(self.log_path, lines)


def tail_of(log_path: pathlib.Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ("" before it exists)."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _format_value(value: object) -> str:
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("\n...")


def wait_healthy(address: str, timeout: float, service: str = "", client: ClientConfig | None = None) -> None:
    """Block until the standard health check of `address` (reached as `client` says) says SERVING."""
    deadline = time.monotonic() + timeout
    with connect_sync(address, client) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")
            time.sleep(0.05)


def start_service(
    name: str,
    overrides: Mapping[str, object] | None = None,
    *,
    config_path: str | os.PathLike | None = None,
    log_dir: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    check_health: bool = True,
    registry: str | os.PathLike | None = None,
    label: str | None = None,
    client: ClientConfig | None = None,
) -> ServiceProcess:
    """Start `relayrl serve NAME` as a process and wait until it serves.

    `label` (default NAME) names it in the run: its log file, its registry entry, its supervised member.

    `overrides` become `--set key=value` (values YAML-encoded). Unless given, the service binds a free
    loopback port; the bound port comes back through a port file. With `registry` (a run's services.json,
    deploy.record.service_registry) the service exports /metrics on a free port unless told otherwise, and its
    address, metrics port and pid are recorded there once it serves (again after each restart), for
    `relayrl status RUN_DIR`. `client` says how to reach it (TLS, token) for its health checks.
    """
    overrides = dict(overrides or {})
    if registry is not None:
        overrides.setdefault("server.metrics_port", 0)
    log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="relayrl-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port_file = log_dir / f"{name}-{os.getpid()}-{time.monotonic_ns()}.port"
    overrides.setdefault("server.address", "127.0.0.1:0")
    overrides["server.port_file"] = str(port_file)
    cmd = [sys.executable, "-m", "deploy.cli", "serve", name]
    if config_path is not None:
        cmd += ["--config", str(config_path)]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={_format_value(value)}"]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    child_env.update(env or {})
    label = label or name
    log_path = log_dir / f"{label}.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env,
                                cwd=pathlib.Path(__file__).resolve().parents[2])
    service = ServiceProcess(label, proc, address="", log_path=log_path, port_file=port_file, kind=name,
                             overrides={k: v for k, v in overrides.items() if k != "server.port_file"},
                             config_path=config_path, env=env,
                             registry=pathlib.Path(registry) if registry is not None else None, client=client)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if not service.alive():
            raise LaunchError(f"{label} exited with code {proc.returncode} before serving:\n{service.log_tail()}")
        if time.monotonic() > deadline:
            service.kill()
            raise LaunchError(f"{label} did not start within {timeout:.0f}s:\n{service.log_tail()}")
        time.sleep(0.05)
    info = json.loads(port_file.read_text())
    host = str(overrides["server.address"]).rsplit(":", 1)[0]
    host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "") else host
    service.address = f"{host}:{info['port']}"
    service.metrics_port = info.get("metrics_port")
    if check_health:
        try:
            wait_healthy(service.address, max(1.0, deadline - time.monotonic()), client=client)
        except TimeoutError as exc:
            service.kill()
            raise LaunchError(f"{label}: {exc}\n{service.log_tail()}") from None
    if service.registry is not None:
        service_registry.record(service.registry, label, service.address, service.metrics_port, service.pid,
                                log_path, kind=name)
    return service
