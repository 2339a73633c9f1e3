"""Typed configuration: pydantic models loaded from YAML with `--set key=value` overrides."""

import pathlib
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

T = TypeVar("T", bound=BaseModel)


class Strict(BaseModel):
    """Base for every config: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class TLSConfig(Strict):
    """Server-side TLS. With `client_ca` set, clients must present a certificate it signed (mTLS)."""

    cert: str = Field(description="PEM file of the server certificate chain.")
    key: str = Field(description="PEM file of the server private key.")
    client_ca: str | None = Field(None, description="PEM file of the CA that signs client certificates (mTLS).")


class AuthConfig(Strict):
    """Bearer tokens mapped to roles, and which roles may call which RPC."""

    tokens: dict[str, str] = Field(
        default_factory=dict, description="token -> role, e.g. {'s3cret': 'trainer'}."
    )
    tokens_file: str | None = Field(None, description="YAML file with more token -> role entries (keeps secrets out of the config).")
    allow: dict[str, list[str]] = Field(
        default_factory=dict,
        description="RPC -> roles allowed. Keys are full method names ('/relayrl.buffer.v1.Buffer/Ack'), a "
        "service ('relayrl.buffer.v1.Buffer') or '*'. The most specific key wins.",
    )
    open_methods: list[str] = Field(
        default_factory=lambda: ["/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"],
        description="Methods callable without a token (health checks for load balancers).",
    )


class TracingConfig(Strict):
    """Where a process's spans go and how many of the job's samples are traced (docs/observability.md)."""

    sample_rate: float = Field(
        0.1, ge=0, le=1, description="The share of the driver's groups whose life is traced (decided at admission; "
        "every other process follows the decision the trace context carries). 0 = none.")
    dir: str | None = Field(
        None, description="Folder for this process's spans as JSON lines (spans-<service>-<pid>.jsonl); an "
        "experiment run sets it to RUN_DIR/traces. None and no otlp_endpoint: tracing is off.")
    otlp_endpoint: str | None = Field(
        None, description="An OTLP/HTTP traces endpoint (Jaeger, Tempo, an OpenTelemetry collector), e.g. "
        "http://127.0.0.1:4318/v1/traces; spans go there too.")
    export_interval_s: float = Field(1.0, gt=0, description="How often the batch processor writes out spans.")

    @property
    def enabled(self) -> bool:
        return (self.dir is not None or self.otlp_endpoint is not None) and self.sample_rate > 0


class StageReportConfig(Strict):
    """A service's stage reports (services/stage_reports.py, docs/observability.md)."""

    dir: str | None = Field(None, description="Folder for <service>-<pid>.jsonl, one line per interval; an experiment "
                            "run sets it to RUN_DIR/stages. None: no reports.")
    interval_s: float = Field(5.0, gt=0, description="The reports' interval.")


class ServerConfig(Strict):
    """How a service listens; shared by every relayrl server."""

    address: str = Field("127.0.0.1:0", description="host:port to bind; port 0 picks a free port.")
    port_file: str | None = Field(None, description="Write the bound port here once serving (for launchers and tests).")
    metrics_port: int | None = Field(None, description="Prometheus /metrics HTTP port; None = off, 0 = any free port.")
    grace_s: float = Field(5.0, ge=0, description="On SIGTERM, how long in-flight calls may run before they are cancelled.")
    max_message_bytes: int = Field(256 << 20, gt=0, description="Largest message sent or received.")
    max_concurrent_rpcs: int | None = Field(None, gt=0, description="Calls served at once; beyond it RESOURCE_EXHAUSTED.")
    tls: TLSConfig | None = Field(None, description="TLS / mTLS; off by default (loopback).")
    auth: AuthConfig | None = Field(None, description="Bearer-token auth; off by default (loopback).")
    insecure: bool = Field(False, description="Serve a non-loopback address with auth off (no bearer tokens, no mTLS). "
                           "Without it such a server refuses to start: anyone who can reach it could call it.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Where this service's spans go "
                                   "(services/tracing.py); off unless tracing.dir or tracing.otlp_endpoint is set.")
    stage_reports: StageReportConfig = Field(default_factory=StageReportConfig, description="Where this service's "
                                             "stage reports go (services/stage_reports.py); off unless dir is set.")


class ClientConfig(Strict):
    """How a client reaches a service."""

    token: str | None = Field(None, description="Bearer token sent as 'authorization: Bearer <token>'.")
    token_file: str | None = Field(None, description="A file holding the token (read when a channel is made), which "
                                   "keeps it out of config files and command lines; `token` wins when both are set.")
    ca_cert: str | None = Field(None, description="PEM CA to verify the server (TLS on when set).")
    cert: str | None = Field(None, description="Client certificate PEM (mTLS).")
    key: str | None = Field(None, description="Client key PEM (mTLS).")
    server_name: str | None = Field(None, description="Override the TLS server name to verify.")
    max_message_bytes: int = Field(256 << 20, gt=0)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=1' -> (['a', 'b'], 1). The value is parsed as YAML, so '[1, 2]' and 'null' work."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected key=value")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {} if child is None else _as_dict(child, part)
        node = child
    node[path[-1]] = value


def _as_dict(value: Any, part: str) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.model_dump()
    raise ConfigError(f"override: {part} is {type(value).__name__}, not a section")


def load_config(cls: type[T], path: str | pathlib.Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Load `cls` from a YAML file (optional), apply overrides, validate. Errors name the field."""
    data: dict[str, Any] = {}
    if path is not None:
        text = pathlib.Path(path).read_text()
        loaded = yaml.safe_load(text)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded or {}
    for item in overrides:
        apply_override(data, *parse_override(item))
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid {cls.__name__}{where}: {problems}") from None
