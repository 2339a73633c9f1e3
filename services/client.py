"""Client channels to relayrl services, with message limits, TLS and bearer tokens when configured.

A target that names several servers of a stateless service balances its calls round-robin over them (gRPC's own
client-side `round_robin` policy) and skips one that is down: several replicas' addresses (`replicas_target`, e.g.
`ipv4:127.0.0.1:5001,127.0.0.1:5002`), or a `dns:///NAME:PORT` target (a Kubernetes headless Service's pods). Any
other target keeps gRPC's default (pick_first): a server that restarts on its address is connected to again at
the next call, where round_robin would fail calls fast while its reconnect backs off.
"""

import ipaddress
import pathlib

import grpc

from services.config import ClientConfig
from services.tracing import client_interceptors


def _options(target: str, config: ClientConfig) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # A restarted service (the local launcher restarts what dies) is found again within ~2 s, not
        # after grpc's default backoff of up to 120 s.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if len(target_addresses(target)) > 1 or target.startswith("dns:"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    return options


def replicas_target(addresses: list[str]) -> str:
    """One gRPC target naming every HOST:PORT of `addresses` (IP literals; IPv6 ones in brackets): the address
    itself when there is one, else `ipv4:A,B,...` or `ipv6:[A],[B],...`, which a channel balances round-robin."""
    if len(addresses) == 1:
        return addresses[0]
    versions = set()
    for address in addresses:
        host = address.rsplit(":", 1)[0].strip("[]")
        try:
            versions.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise ValueError(f"{address}: replicas in one target need IP addresses, not host names") from None
    if len(versions) > 1:
        raise ValueError(f"{addresses}: replicas in one target need all IPv4 or all IPv6 addresses")
    return f"ipv{versions.pop()}:{','.join(addresses)}"


def target_addresses(target: str) -> list[str]:
    """The HOST:PORT addresses a target names (those of an `ipv4:` / `ipv6:` list, else the target itself)."""
    scheme, _, rest = target.partition(":")
    return rest.split(",") if scheme in ("ipv4", "ipv6") else [target]


def _is_loopback(target: str) -> bool:
    hosts = [address.rsplit(":", 1)[0].strip("[]") for address in target_addresses(target)]
    return all(host in ("localhost", "::1") or host.startswith("127.") for host in hosts)


def bearer_token(config: ClientConfig) -> str | None:
    """The token a client presents: config.token, else the content of config.token_file; None for neither."""
    if config.token:
        return config.token
    return pathlib.Path(config.token_file).read_text().strip() if config.token_file else None


def _credentials(address: str, config: ClientConfig) -> grpc.ChannelCredentials | None:
    channel_creds = None
    if config.ca_cert:
        read = lambda p: pathlib.Path(p).read_bytes() if p else None
        channel_creds = grpc.ssl_channel_credentials(read(config.ca_cert), read(config.key), read(config.cert))
    token = bearer_token(config)
    if token:
        call_creds = grpc.access_token_call_credentials(token)
        if channel_creds is None:
            # A bearer token never crosses a network in plaintext: without TLS, loopback only.
            if not _is_loopback(address):
                raise ValueError(f"a token to {address} needs TLS: set ca_cert (plaintext is loopback-only)")
            channel_creds = grpc.local_channel_credentials()
        channel_creds = grpc.composite_channel_credentials(channel_creds, call_creds)
    return channel_creds


def connect(address: str, config: ClientConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address` (HOST:PORT, or any gRPC target: `replicas_target`)."""
    config = config or ClientConfig()
    creds = _credentials(address, config)
    interceptors = client_interceptors() or None  # the trace context into each call's metadata (tracing on)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=_options(address, config), interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options=_options(address, config), interceptors=interceptors)


def connect_sync(address: str, config: ClientConfig | None = None) -> grpc.Channel:
    """A blocking channel to `address` (HOST:PORT, or any gRPC target)."""
    config = config or ClientConfig()
    creds = _credentials(address, config)
    if creds is None:
        return grpc.insecure_channel(address, options=_options(address, config))
    return grpc.secure_channel(address, creds, options=_options(address, config))
