"""Rollout replicas of a local run: a router (named "rollout" in the run) in front of N `relayrl serve rollout`
processes ("rollout-1", "rollout-2", ...), each supervised, and scaled while the run goes on.

Everything else in the run (driver, evaluation, trainer, `relayrl status`) talks to the router's address as it
would to one rollout service; the trainer publishes to every replica the router lists (publish.receivers_from).
Scaling goes through the run folder, so that `relayrl deploy scale rollout N --run RUN_DIR` (deploy/local/scale.py)
reaches the process that supervises the run:

    RUN_DIR/scale/rollout.json          asked: {"id": ..., "replicas": N}
    RUN_DIR/scale/rollout.result.json   done:  {"id": ..., "replicas": [names], "added": [...], "removed": {...}}

The processes start through the run's launcher: on this machine (deploy.local.launcher.LocalLauncher), or each
replica and the router on a node of the rollout's group of a Ray cluster (deploy/cluster/ray_launcher.py, one agent each).

Up: a new replica process starts, is supervised and recorded, and is added to the router as JOINING; it takes
traffic once it serves the weight version the others serve (the trainer's next publish reaches it). Down: the
newest replicas leave the router first (no new traffic; in-flight requests finish), then their processes stop.
Lost (its node is gone, deploy/cluster/ray_launcher.py): a new replica starts in its place, on a node that is left, and
joins as one scaled up does; then the lost one leaves the router (its requests re-ran on the others) and the run's
services.json.
"""

import json
import logging
import os
import pathlib
import threading

import grpc

from deploy.local.launcher import LocalLauncher
from deploy.local.service_process import ServiceProcess
from deploy.record import service_registry
from protos import router_pb2, router_pb2_grpc
from services.client import connect_sync

log = logging.getLogger("relayrl.replicas")
SCALE_DIR = "scale"
LOST_DRAIN_S = 1.0  # a lost replica's drain: what it had in flight is re-run on the others, not waited for


def request_path(run_dir: pathlib.Path, service: str) -> pathlib.Path:
    return run_dir / SCALE_DIR / f"{service}.json"


def result_path(run_dir: pathlib.Path, service: str) -> pathlib.Path:
    return run_dir / SCALE_DIR / f"{service}.result.json"


def write_json(path: pathlib.Path, data: dict) -> None:
    """Written whole or not at all (a reader polling it never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def scaled_replicas(run_dir: pathlib.Path, service: str) -> int | None:
    """How many replicas the last scale request this run answered left running; None if it answered none. A
    resumed run (a fresh one starts in an empty folder) starts that many rather than its configured count."""
    result = result_path(run_dir, service)
    if not result.exists():
        return None
    answer = json.loads(result.read_text())
    return len(answer["replicas"]) if "replicas" in answer else None


class RolloutReplicas:
    """The router and its replica processes, started and scaled under the run's supervisor."""

    def __init__(self, supervisor, overrides: dict, logs: pathlib.Path, run_dir: pathlib.Path, launcher=None,
                 join_wait_s: float = 120.0, drain_timeout_s: float = 120.0, client=None):
        """`overrides`: the rollout service's --set overrides; a fixed `server.address` is the router's (the
        replicas take free ports), its other `server` settings (TLS, auth) are the router's too. `launcher` starts
        the processes (deploy.local.launcher.LocalLauncher by default). `client` (services.config.ClientConfig): how the
        run reaches the rollout, so how the router reaches its replicas and this object the router."""
        self.supervisor, self.logs, self.run_dir = supervisor, logs, run_dir
        self.launcher = launcher or LocalLauncher()
        self.client = client
        self.overrides = {k: v for k, v in overrides.items() if k != "server.address"}
        self.router_address = overrides.get("server.address")
        self.registry = run_dir / service_registry.REGISTRY_FILE
        self.join_wait_s, self.drain_timeout_s = join_wait_s, drain_timeout_s
        self.replicas: dict[str, ServiceProcess] = {}  # name -> process, oldest first
        self.router: ServiceProcess | None = None
        self._started = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handled: str | None = None
        self._lock = threading.Lock()  # a scale request and a lost replica's replacement change the set one at a time

    def start(self, replicas: int) -> ServiceProcess:
        """Start `replicas` replicas (or as many as a resumed run was scaled to) and the router in front of them;
        then answer scale requests on a thread."""
        scaled = scaled_replicas(self.run_dir, "rollout")
        if scaled is not None and scaled != replicas:
            log.warning("rollout: %d replicas, as this run was scaled to (configured: %d)", scaled, replicas)
            replicas = scaled
        for _ in range(replicas):
            self._start_replica()
        server = {k: v for k, v in self.overrides.items() if k == "server" or k.startswith("server.")}
        # The router keeps its replica set (scaled, replaced) in the run folder across its own restarts; this run's
        # replicas are new ones, so an earlier process's set (a resumed run) is gone first.
        kept = self.run_dir / SCALE_DIR / "router_replicas.json"
        kept.unlink(missing_ok=True)
        kept.parent.mkdir(parents=True, exist_ok=True)
        router = {**server, "model": self.overrides["model"], "router.poll_s": 0.5,
                  "router.replicas": [p.address for p in self.replicas.values()], "router.replicas_file": str(kept)}
        if self.client is not None:
            router["router.client"] = self.client.model_dump(exclude_defaults=True)
        if self.router_address:
            router["server.address"] = self.router_address
        self.router = self.supervisor.add_service(self.launcher.service("rollout", router, self.logs, self.registry,
                                                                        client=self.client))
        request = request_path(self.run_dir, "rollout")
        if request.exists():  # a request of an earlier process of this run (resumed) is not this run's to answer
            self._handled = json.loads(request.read_text())["id"]
        self._thread = threading.Thread(target=self._serve_requests, name="rollout-scale", daemon=True)
        self._thread.start()
        return self.router

    def scale_to(self, replicas: int) -> dict:
        """Add or drain-and-stop replicas until `replicas` run; what was done."""
        if replicas < 1:
            raise ValueError(f"replicas: at least 1, got {replicas}")
        added, removed = [], {}
        with self._lock, connect_sync(self.router.address, self.client) as channel:
            control = router_pb2_grpc.ReplicasStub(channel)
            while len(self.replicas) < replicas:
                name, process = self._start_replica()
                info = control.AddReplica(router_pb2.AddReplicaRequest(address=process.address,
                                                                       wait_s=self.join_wait_s),
                                          timeout=self.join_wait_s + 10)
                added.append(name)
                log.warning("rollout replica %s at %s added (%s, weight version %d)", name, process.address,
                            router_pb2.ReplicaState.Name(info.state), info.weight_version)
            while len(self.replicas) > replicas:
                name, process = list(self.replicas.items())[-1]
                reply = control.RemoveReplica(router_pb2.RemoveReplicaRequest(
                    address=process.address, drain_timeout_s=self.drain_timeout_s), timeout=self.drain_timeout_s + 10)
                self.supervisor.stop_member(name)
                self.launcher.release(name)
                service_registry.forget(self.registry, name)
                del self.replicas[name]
                removed[name] = {"drained": reply.drained, "in_flight": reply.in_flight, "sessions": reply.sessions}
                log.warning("rollout replica %s removed: %s", name, removed[name])
        return {"replicas": list(self.replicas), "added": added, "removed": removed}

    def replace(self, name: str) -> None:
        """A replica whose node was lost (the supervisor's replacer): another starts in its place, joins the router
        (routed to once it serves the current weights), and the lost one leaves the router and services.json."""
        with self._lock, connect_sync(self.router.address, self.client) as channel:
            lost = self.replicas.pop(name)
            service_registry.forget(self.registry, name)
            new, process = self._start_replica()
            control = router_pb2_grpc.ReplicasStub(channel)
            control.AddReplica(router_pb2.AddReplicaRequest(address=process.address), timeout=30)
            control.RemoveReplica(router_pb2.RemoveReplicaRequest(address=lost.address, drain_timeout_s=LOST_DRAIN_S),
                                  timeout=LOST_DRAIN_S + 30)
            log.warning("rollout replica %s lost its node; %s at %s took its place", name, new, process.address)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.drain_timeout_s + self.join_wait_s + 30)

    def _start_replica(self) -> tuple[str, ServiceProcess]:
        self._started += 1
        name = f"rollout-{self._started}"
        process = self.supervisor.add_service(self.launcher.service("rollout", self.overrides, self.logs,
                                                                    self.registry, label=name, client=self.client),
                                              replace=self.replace)
        self.replicas[name] = process
        return name, process

    def _serve_requests(self) -> None:
        request = request_path(self.run_dir, "rollout")
        while not self._stop.wait(0.5):
            if not request.exists():
                continue
            asked = json.loads(request.read_text())
            if asked["id"] == self._handled:
                continue
            self._handled = asked["id"]
            try:
                result = {"id": asked["id"], **self.scale_to(int(asked["replicas"]))}
            except (ValueError, grpc.RpcError, RuntimeError) as exc:  # LaunchError is a RuntimeError
                result = {"id": asked["id"], "replicas": list(self.replicas), "error": str(exc)}
                log.error("scaling rollout to %s failed: %s", asked["replicas"], exc)
            write_json(result_path(self.run_dir, "rollout"), result)
