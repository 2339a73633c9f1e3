"""Distributed tracing: one OpenTelemetry tracer provider per process, trace context in gRPC metadata and in samples.

A sample's life is one trace across processes: the driver's admission of its group is the root span; the
driver's Generate / Score / Put calls carry the context in gRPC metadata (`traceparent`, W3C Trace Context) so the
rollout's, the reward's and the buffer's server spans are its children; the sample itself carries the context of
its own span in `Sample.metadata["traceparent"]`, so the buffer's lease and ack and the trainer's step (a span per
sample, a child of it, and the step's span, linking every sample it consumed) join the same trace however long the
sample waited in the durable buffer.

Tracing is off unless `tracing.dir` (a JSON-lines file per process, `spans-<service>-<pid>.jsonl`) or
`tracing.otlp_endpoint` is set: then no provider exists and every hook here is a no-op. Sampling is decided once,
at the root (`sample_rate` of the driver's groups), and followed by every process (a parent-based sampler);
spans go out through a BatchSpanProcessor, off the calling thread.
"""

import atexit
import json
import os
import pathlib
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.config import TracingConfig

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_NOOP = trace.NoOpTracer()


class _RootSampler(Sampler):
    """A root span is sampled at `rate`, or always when it links a sampled span (a train step linking traced
    samples: its own trace is kept whenever one of theirs is)."""

    def __init__(self, rate: float) -> None:
        self._ratio = TraceIdRatioBased(rate)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        if links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self._ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"RootSampler({self._ratio.get_description()})"


class JsonLinesExporter(SpanExporter):
    """Each span as one JSON line in a file (what `relayrl trace RUN_DIR` reads)."""

    def __init__(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(span)) + "\n" for span in spans)
        with self._lock, open(self.path, "a") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as the JSON-lines record: ids in hex, times in ns since the epoch."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "pid": os.getpid(),
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in span.links],
    }


_provider: TracerProvider | None = None


def setup_tracing(service: str, config: TracingConfig | None) -> bool:
    """Install this process's tracer provider for `service` as `config` says; whether tracing is on."""
    global _provider
    if config is None or not config.enabled:
        return False
    shutdown_tracing()
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(_RootSampler(config.sample_rate)))
    delay_ms = int(config.export_interval_s * 1000)
    if config.dir is not None:
        path = pathlib.Path(config.dir) / f"spans-{service}-{os.getpid()}.jsonl"
        provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(path), schedule_delay_millis=delay_ms))
    if config.otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint),
                                                       schedule_delay_millis=delay_ms))
    _provider = provider
    return True


def shutdown_tracing() -> None:
    """Write out what is queued and remove the provider (at exit, and before a provider is installed again)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


atexit.register(shutdown_tracing)


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    return _provider.get_tracer("relayrl") if _provider is not None else _NOOP


# --- context in carriers: gRPC metadata and sample metadata ---------------------------------------------------------

def current_traceparent() -> str | None:
    """The W3C traceparent of the current span when it is sampled, else None."""
    if _provider is None or not trace.get_current_span().get_span_context().trace_flags.sampled:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT)


def context_of(traceparent: str | None) -> otel_context.Context | None:
    """The context a traceparent names (None for None or a malformed one)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({TRACEPARENT: traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def span_context_of(traceparent: str | None) -> trace.SpanContext | None:
    ctx = context_of(traceparent)
    return trace.get_current_span(ctx).get_span_context() if ctx is not None else None


def sample_traceparent(metadata: dict[str, Any]) -> str | None:
    value = metadata.get(TRACEPARENT)
    return value if isinstance(value, str) else None


def payload_traceparent(payload: bytes) -> str | None:
    """The traceparent inside a serialized common_pb2.Sample (the buffer holds samples as bytes)."""
    from protos import common_pb2
    from protos.codec import unpack_metadata

    return sample_traceparent(unpack_metadata(common_pb2.Sample.FromString(payload).metadata))


# --- spans -------------------------------------------------------------------------------------------------------------

@contextmanager
def span(name: str, parent: str | None = None, **attributes: Any) -> Iterator[trace.Span | None]:
    """A span around a block: a child of the current span, or of the traceparent `parent`; nothing when off."""
    if _provider is None:
        yield None
        return
    ctx = context_of(parent) if parent is not None else None
    with tracer().start_as_current_span(name, context=ctx, attributes=attributes) as current:
        yield current


def record_span(name: str, parent: str | None, start_ns: int, end_ns: int | None = None,
                links: Sequence[str] = (), **attributes: Any) -> str | None:
    """A span recorded after the fact (a child of `parent`, linking the traceparents `links`); its traceparent."""
    if _provider is None:
        return None
    ctx = context_of(parent)
    if parent is not None and ctx is None:
        return None
    link_list = [Link(context) for context in map(span_context_of, links) if context is not None]
    if parent is None and not link_list:
        return None
    recorded = tracer().start_span(name, context=ctx, links=link_list, attributes=attributes, start_time=start_ns)
    recorded.end(end_time=end_ns if end_ns is not None else time.time_ns())
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(recorded))
    return carrier.get(TRACEPARENT)


def record_consumption(name: str, traceparents: Sequence[str | None], start_ns: int, end_ns: int | None = None,
                       **attributes: Any) -> None:
    """A step that consumed samples: its span (its own trace, linking each traced sample's context) and, in each
    sample's trace, a child span of the sample linking back to it."""
    traced = [tp for tp in traceparents if tp is not None]
    if _provider is None or not traced:
        return
    end_ns = end_ns if end_ns is not None else time.time_ns()
    step = record_span(name, None, start_ns, end_ns, links=traced, samples=len(traced), **attributes)
    for traceparent in traced:
        record_span(name, traceparent, start_ns, end_ns, links=[step] if step else (), **attributes)


def carry_context(coro):
    """`coro` to run on another thread's event loop under the caller's trace context (unchanged while off)."""
    if _provider is None:
        return coro
    caller = otel_context.get_current()

    async def in_context():
        token = otel_context.attach(caller)
        try:
            return await coro
        finally:
            otel_context.detach(token)

    return in_context()


def server_span(method: str, invocation_metadata) -> Any:
    """Around a served call whose caller sent a traceparent: its server span (else nothing)."""
    if _provider is None or not invocation_metadata:
        return nullcontext()
    parent = next((value for key, value in invocation_metadata if key == TRACEPARENT), None)
    ctx = context_of(parent if isinstance(parent, str) else None)
    if ctx is None:
        return nullcontext()
    return tracer().start_as_current_span(method.lstrip("/"), context=ctx, kind=SpanKind.SERVER)


def client_interceptors() -> list:
    """Interceptors for an asyncio channel that put the current trace context into each call's metadata
    (none while tracing is off)."""
    if _provider is None:
        return []
    import grpc

    def with_context(details):
        traceparent = current_traceparent()
        if traceparent is None:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (TRACEPARENT, traceparent))
        return details._replace(metadata=metadata)

    class Inject(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_unary(self, continuation, client_call_details, request):
            return await continuation(with_context(client_call_details), request)

        async def intercept_unary_stream(self, continuation, client_call_details, request):
            return await continuation(with_context(client_call_details), request)

    return [Inject()]
