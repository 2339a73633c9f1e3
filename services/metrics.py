"""Prometheus metrics every relayrl server exports, and the /metrics endpoint."""

from prometheus_client import Counter, Histogram, start_http_server

RPC_STARTED = Counter("relayrl_rpc_started_total", "RPCs started", ["service", "method"])
RPC_HANDLED = Counter("relayrl_rpc_handled_total", "RPCs finished, by status code", ["service", "method", "code"])
RPC_LATENCY = Histogram(
    "relayrl_rpc_latency_seconds",
    "RPC handling time (streams: until the stream ends)",
    ["service", "method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


def split_method(full_method: str) -> tuple[str, str]:
    """'/relayrl.buffer.v1.Buffer/Ack' -> ('relayrl.buffer.v1.Buffer', 'Ack')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def start_metrics_endpoint(port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics over HTTP on `host`:`port` (0 = any free port); returns the bound port."""
    server, _thread = start_http_server(port, addr=host)
    return server.server_port
