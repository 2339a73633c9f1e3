"""create_server: a grpc.aio server with health, reflection, auth, metrics and message limits."""

import asyncio
import contextlib
import inspect
import logging
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from protos.codec import CodecError
from services.auth import Authorizer, Denied
from services.config import ServerConfig
from services.metrics import RPC_HANDLED, RPC_LATENCY, RPC_STARTED, split_method
from services.net import is_loopback, split_host
from services.tracing import server_span

log = logging.getLogger(__name__)

# (add_XServicer_to_server, servicer, full service name)
Registration = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


def _status_name(context: grpc.aio.ServicerContext, ended: str) -> str:
    """The call's status code: the one the handler set, else how it ended (OK, UNKNOWN or CANCELLED)."""
    code = context.code()
    if code is None:
        return ended
    return code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code).name


class _Undecodable:
    """Request bytes that do not parse as the method's message (grpc would answer UNKNOWN)."""

    def __init__(self, reason: str):
        self.reason = reason


def _lenient(deserializer):
    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, custom decoders others
            return _Undecodable(f"request does not parse: {exc}")

    return decode


async def _checked_stream(requests):
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise CodecError(request.reason)
        yield request


def _check_request(request, streaming: bool):
    if streaming:
        return _checked_stream(request)
    if isinstance(request, _Undecodable):
        raise CodecError(request.reason)
    return request


class _Interceptor(grpc.aio.ServerInterceptor):
    """Checks auth, counts and times every call, and turns CodecError into INVALID_ARGUMENT."""

    def __init__(self, authorizer: Authorizer | None):
        self.authorizer = authorizer

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        denied = None
        if self.authorizer is not None:
            try:
                self.authorizer.check(method, details.invocation_metadata)
            except Denied as exc:
                denied = exc
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary"
        )
        behavior = getattr(handler, kind)
        wrap = _wrap_stream if handler.response_streaming else _wrap_unary
        replaced = {kind: wrap(behavior, method, denied, handler.request_streaming)}
        if handler.request_deserializer is not None:
            replaced["request_deserializer"] = _lenient(handler.request_deserializer)
        return handler._replace(**replaced)


@contextlib.asynccontextmanager
async def _observed(method: str, context: grpc.aio.ServicerContext, denied: Denied | None):
    """Around every handler: refuse a denied call, map CodecError to INVALID_ARGUMENT, count and time it."""
    service, name = split_method(method)
    RPC_STARTED.labels(service, name).inc()
    start, ended = time.perf_counter(), "OK"
    try:
        if denied is not None:
            await context.abort(denied.code, str(denied))
        yield
    except CodecError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except grpc.aio.AbortError:
        raise
    except (asyncio.CancelledError, GeneratorExit):  # the client cancelled (a trainer's Pull stream ends so)
        ended = "CANCELLED"
        raise
    except BaseException:
        ended = "UNKNOWN"
        raise
    finally:
        RPC_LATENCY.labels(service, name).observe(time.perf_counter() - start)
        RPC_HANDLED.labels(service, name, _status_name(context, ended)).inc()


def _wrap_unary(behavior, method: str, denied: Denied | None, request_streaming: bool):
    async def wrapper(request, context):
        with server_span(method, context.invocation_metadata()):  # a span when the caller sent a trace context
            async with _observed(method, context, denied):
                return await behavior(_check_request(request, request_streaming), context)

    return wrapper


def _wrap_stream(behavior, method: str, denied: Denied | None, request_streaming: bool):
    async def wrapper(request, context):
        async with _observed(method, context, denied):
            result = behavior(_check_request(request, request_streaming), context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:
                await result

    return wrapper


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    tls = config.tls
    assert tls is not None
    key, cert = pathlib.Path(tls.key).read_bytes(), pathlib.Path(tls.cert).read_bytes()
    client_ca = pathlib.Path(tls.client_ca).read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


class InsecureAddress(ValueError):
    """A server without authentication was asked to listen beyond loopback."""


def check_exposure(address: str, config: ServerConfig) -> None:
    """Refuse a non-loopback address unless callers must authenticate (tokens or mTLS) or `insecure` says so."""
    authenticated = config.auth is not None or (config.tls is not None and config.tls.client_ca is not None)
    if authenticated or config.insecure or is_loopback(split_host(address)):
        return
    raise InsecureAddress(
        f"server.address={address} is reachable beyond this machine and auth is off: set server.auth (bearer "
        "tokens) or server.tls.client_ca (mTLS), or pass --insecure (server.insecure=true) to serve it open anyway"
    )


async def create_server(
    address: str, services: Sequence[Registration], config: ServerConfig | None = None
) -> tuple[grpc.aio.Server, int]:
    """Build (not start) a server for `services` bound to `address`; returns (server, bound port).

    Every server gets grpc.health.v1 (each service SERVING once started), server reflection, the auth
    and metrics interceptor, and the configured message-size limits. The HealthServicer is reachable
    as `server.health` so a service can report NOT_SERVING while it cannot serve.
    """
    config = config or ServerConfig(address=address)
    check_exposure(address, config)
    authorizer = Authorizer(config.auth) if config.auth else None
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(
        interceptors=[_Interceptor(authorizer)],
        options=options,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME], server)
    if config.tls:
        port = server.add_secure_port(address, _server_credentials(config))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    server.health = health  # type: ignore[attr-defined]
    return server, port
