"""The server runtime in-process: health, reflection, bearer-token roles, TLS and mTLS.

Health and reflection are real services on every relayrl server, so they exercise the auth
interceptor and TLS without any stand-in.
"""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.client import connect
from services.config import AuthConfig, ClientConfig, ServerConfig, TLSConfig
from services.server import create_server
from tests.pki_kit import make_pki

REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


async def _list_services(channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(timeout=5)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    return sorted(s.name for s in reply.list_services_response.service)


async def _health(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


@pytest.fixture
async def auth_server():
    auth = AuthConfig(tokens={"a-token": "agent", "admin-token": "admin"}, allow={REFLECTION: ["admin"]})
    server, port = await create_server("127.0.0.1:0", [], ServerConfig(auth=auth))
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_roles_no_token_wrong_role_right_role(auth_server):
    async with connect(auth_server) as channel:
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING  # health stays open
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list_services(channel)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with connect(auth_server, ClientConfig(token="wrong")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list_services(channel)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with connect(auth_server, ClientConfig(token="a-token")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list_services(channel)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "role 'agent' may not call" in err.value.details()
    async with connect(auth_server, ClientConfig(token="admin-token")) as channel:
        assert REFLECTION in await _list_services(channel)


def test_tokens_never_travel_in_plaintext_off_loopback():
    with pytest.raises(ValueError, match="needs TLS"):
        connect("10.0.0.1:5000", ClientConfig(token="t"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, made here."""
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _serve_tls(pki, mtls: bool):
    cert, key = pki["server"]
    tls = TLSConfig(cert=cert, key=key, client_ca=pki["ca"] if mtls else None)
    server, port = await create_server("127.0.0.1:0", [], ServerConfig(tls=tls))
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_tls_server_certificate(pki):
    server, address = await _serve_tls(pki, mtls=False)
    try:
        async with connect(address, ClientConfig(ca_cert=pki["ca"], server_name="localhost")) as channel:
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        async with connect(address) as plaintext:  # a plaintext client cannot talk to a TLS server
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _health(plaintext)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_mtls_requires_a_client_certificate(pki):
    server, address = await _serve_tls(pki, mtls=True)
    try:
        cert, key = pki["client"]
        good = ClientConfig(ca_cert=pki["ca"], cert=cert, key=key, server_name="localhost")
        async with connect(address, good) as channel:
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        async with connect(address, ClientConfig(ca_cert=pki["ca"], server_name="localhost")) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _health(channel)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


def test_token_check_compares_every_known_token_in_constant_time(monkeypatch):
    """The role is found by hmac.compare_digest over SHA-256 digests of every token (no dict lookup on the
    secret, no early exit on the first match), and the plain tokens are not kept."""
    import hmac

    from services.auth import Authorizer

    authorizer = Authorizer(AuthConfig(tokens={"tok-a": "agent", "tok-b": "admin", "tok-c": "trainer"}))
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    assert authorizer.check("/relayrl.x.v1.X/Y", [("authorization", "Bearer tok-a")]) == "agent"
    assert calls == [(32, 32)] * 3
    calls.clear()
    with pytest.raises(Exception, match="invalid bearer token"):
        authorizer.check("/relayrl.x.v1.X/Y", [("authorization", "Bearer tok-" + "x" * 100)])
    assert calls == [(32, 32)] * 3
    assert "tok-a" not in repr(vars(authorizer))


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", ":0", "10.1.2.3:50051"])
async def test_an_open_server_refuses_a_non_loopback_address(address):
    from services.server import InsecureAddress, check_exposure

    with pytest.raises(InsecureAddress, match="--insecure"):
        await create_server(address, [], ServerConfig(address=address))
    check_exposure(address, ServerConfig(address=address, insecure=True))  # told so: allowed
    check_exposure(address, ServerConfig(address=address, auth=AuthConfig(tokens={"t": "admin"})))


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.0.0.2:0", "[::1]:0", "localhost:0"])
def test_loopback_needs_no_auth(address):
    from services.server import check_exposure

    check_exposure(address, ServerConfig(address=address))


def test_relayrl_serve_refuses_an_open_non_loopback_address():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "reward", "--address", "0.0.0.0:0"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "auth is off" in result.stderr and "--insecure" in result.stderr
