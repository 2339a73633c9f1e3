"""What each service of a run is doing right now, read from what the services already export.

Per service: grpc.health.v1 (health), its own RPCs (buffer Stats; rollout GetModelInfo), and, when its
/metrics port is known, the Prometheus counters every server exports (services/metrics.py: RPCs handled
by status code) plus the service's own (rollout running / waiting sequences and generated tokens, reward
scores). Rates come from two polls of cumulative counters. `relayrl status` renders the rows.
"""

import pathlib
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from deploy.record import service_registry
from protos import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.client import connect_sync
from services.config import ClientConfig

# gRPC service name (as reflection lists it) -> relayrl service kind
KINDS = {
    "relayrl.buffer.v1.Buffer": "buffer",
    "relayrl.rollout.v1.Rollout": "rollout",
    "relayrl.reward.v1.Reward": "reward",
}


@dataclass(frozen=True)
class Target:
    """A service to poll: its gRPC address, its kind when known (else probed by reflection), its /metrics port, and
    how its run reaches it (TLS files, token file; None = plain text, no token)."""

    name: str
    address: str
    kind: str | None = None
    metrics_port: int | None = None
    client: ClientConfig | None = None


def parse_address(text: str) -> Target:
    """'HOST:PORT' or 'HOST:PORT/METRICS_PORT' (the service's Prometheus /metrics port, when it exports one)."""
    address, _, metrics = text.partition("/")
    return Target(name=address, address=address, metrics_port=int(metrics) if metrics else None)


def run_targets(run_dir: pathlib.Path) -> list[Target]:
    """The services a run folder records (services.json; FileNotFoundError if none yet), each with the client
    settings the run reached it with (clients.json, deploy/local/security.py)."""
    from deploy.record.private_files import read_clients

    clients = read_clients(run_dir)
    return [Target(e.name, e.address, e.kind or e.name, e.metrics_port, clients.get(e.kind or e.name))
            for e in service_registry.read(run_dir)]


@dataclass
class Poll:
    """One reading of one service. `counters` are cumulative (rates come from two polls)."""

    at: float
    kind: str
    health: str
    problem: str | None = None
    weight_version: int | None = None
    queue: dict[str, int] = field(default_factory=dict)
    staleness: dict[str, int] | None = None
    counters: dict[str, float] = field(default_factory=dict)
    errors: dict[str, int] | None = None  # non-OK RPCs by status code (None: no metrics to read them from)
    metrics: str = "off"  # "on" (read), "off" (no port known), or why it could not be read


@dataclass
class ServiceStatus:
    """One row of `relayrl status`."""

    name: str
    address: str
    kind: str
    health: str  # SERVING, NOT_SERVING, ... or UNREACHABLE
    up: bool
    weight_version: int | None
    queue: dict[str, int]
    staleness: dict[str, int] | None
    throughput: dict[str, float]  # per second, from two polls
    errors: dict | None  # {"total": n, "by_code": {...}}; None: no metrics
    metrics: str
    problem: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def _scrape(host: str, port: int, timeout: float) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page: (sample name, sorted labels) -> value."""
    url = f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sum(samples: dict[tuple[str, tuple], float], name: str) -> float:
    """The sum of one metric over all its labels."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


# Calls this tool makes itself: not counted as the service's work (rpcs/s).
_PROBES = {("relayrl.buffer.v1.Buffer", "Stats"), ("relayrl.rollout.v1.Rollout", "GetModelInfo")}


def _from_metrics(poll: Poll, samples: dict[tuple[str, tuple], float]) -> None:
    """Fill what the Prometheus page says. Errors are RPCs that ended with a status other than OK or CANCELLED (a
    call its client hung up on, as a trainer ends its Pull stream), health checks and reflection (grpc.* services)
    left out; the rpcs rate also leaves out the stats calls of _PROBES."""
    errors: dict[str, int] = {}
    rpcs = 0.0
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if name != "relayrl_rpc_handled_total" or labels["service"].startswith("grpc."):
            continue
        if (labels["service"], labels["method"]) not in _PROBES:
            rpcs += value
        if labels["code"] not in ("OK", "CANCELLED"):
            errors[labels["code"]] = errors.get(labels["code"], 0) + int(value)
    poll.errors = errors
    poll.counters["rpcs"] = rpcs
    if poll.kind == "rollout":
        poll.queue = {"running": int(_sum(samples, "relayrl_rollout_running_sequences")),
                      "waiting": int(_sum(samples, "relayrl_rollout_waiting_sequences"))}
        queued = int(_sum(samples, "relayrl_rollout_sessions_queued"))  # engine.session_admission kv
        if queued:
            poll.queue["sessions queued"] = queued
        longest = _sum(samples, "relayrl_rollout_session_admission_max_wait_s")
        if longest:
            poll.queue["longest admission wait s"] = round(longest, 1)
        poll.counters["tokens"] = _sum(samples, "relayrl_rollout_generated_tokens_total")
        hits = _sum(samples, "relayrl_rollout_session_tier_hits")  # engine.session_kv_tier_bytes: idle sessions' KV
        if hits:
            poll.counters["tier hits"] = hits
            poll.counters["tier tokens restored"] = _sum(samples, "relayrl_rollout_session_tier_tokens_restored")
            poll.counters["tier bytes moved"] = (_sum(samples, "relayrl_rollout_session_tier_bytes_in")
                                                 + _sum(samples, "relayrl_rollout_session_tier_bytes_out"))
    elif poll.kind == "reward":
        poll.counters["scored"] = _sum(samples, "relayrl_reward_score_count")


def _kind(channel: grpc.Channel, timeout: float) -> str:
    """Which relayrl service answers on `channel`, from the services its reflection lists."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        timeout=timeout)
    names = [s.name for reply in replies for s in reply.list_services_response.service]
    return next((KINDS[n] for n in names if n in KINDS), "unknown")


def _from_rpcs(poll: Poll, channel: grpc.Channel, timeout: float) -> None:
    if poll.kind == "buffer":
        stats = buffer_pb2_grpc.BufferStub(channel).Stats(buffer_pb2.StatsRequest(), timeout=timeout)
        poll.weight_version = stats.trainer_version
        poll.queue = {"ready": stats.pending, "leased": stats.leased}
        poll.staleness = {"max_staleness": stats.max_staleness, "dropped_stale": stats.dropped.get("stale", 0)}
        poll.counters.update(put=stats.accepted, acked=stats.acked)
    elif poll.kind == "rollout":
        info = rollout_pb2_grpc.RolloutStub(channel).GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=timeout)
        poll.weight_version = info.weight_version
        if info.paused:
            poll.problem = "paused (weight update)"


def poll(target: Target, client: ClientConfig | None = None, timeout: float = 5.0) -> Poll:
    """Read one service now, reached as `client` says, else as its run reached it (target.client). An address that
    does not answer is a Poll with health UNREACHABLE."""
    with connect_sync(target.address, client or target.client) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            kind = target.kind or _kind(channel, timeout)
        except grpc.RpcError as exc:
            return Poll(time.time(), target.kind or "unknown", "UNREACHABLE", f"{exc.code().name}: {exc.details()}")
        result = Poll(time.time(), kind, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        try:
            _from_rpcs(result, channel, timeout)
        except grpc.RpcError as exc:
            result.problem = f"{kind} stats: {exc.code().name}: {exc.details()}"
    if target.metrics_port is not None:
        host = target.address.rsplit(":", 1)[0].strip("[]")
        try:
            _from_metrics(result, _scrape(host, target.metrics_port, timeout))
            result.metrics = "on"
        except (urllib.error.URLError, OSError) as exc:
            result.metrics = f"unreadable: {exc}"
    return result


def _rates(before: Poll | None, after: Poll) -> dict[str, float]:
    """Per-second rates of the counters both polls read; a counter that went down (a restart) has none."""
    if before is None or after.at <= before.at:
        return {}
    seconds = after.at - before.at
    return {name: (value - before.counters[name]) / seconds for name, value in after.counters.items()
            if name in before.counters and value >= before.counters[name]}


def row(target: Target, before: Poll | None, after: Poll) -> ServiceStatus:
    errors = None if after.errors is None else {"total": sum(after.errors.values()), "by_code": after.errors}
    return ServiceStatus(
        name=target.name, address=target.address, kind=after.kind, health=after.health,
        up=after.health == "SERVING", weight_version=after.weight_version, queue=after.queue,
        staleness=after.staleness, throughput=_rates(before, after), errors=errors, metrics=after.metrics,
        problem=after.problem)


class StatusPoller:
    """Polls a set of services again and again; each refresh's rows carry rates since the previous one.

    `targets` is called on every refresh, so a run whose service restarted (new metrics port, new pid)
    is followed through its services.json.
    """

    def __init__(self, targets, client: ClientConfig | None = None, timeout: float = 5.0):
        self.targets, self.client, self.timeout = targets, client, timeout
        self.previous: dict[str, Poll] = {}

    def refresh(self) -> list[ServiceStatus]:
        rows = []
        for target in self.targets():
            current = poll(target, self.client, self.timeout)
            rows.append(row(target, self.previous.get(target.name), current))
            self.previous[target.name] = current
        return rows
