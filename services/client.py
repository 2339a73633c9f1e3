"""Client channels to relayrl services, with message limits, TLS and bearer tokens when configured."""

import pathlib

import grpc

from services.config import ClientConfig


def _options(config: ClientConfig) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # A restarted service (the local launcher restarts what dies) is found again within ~2 s, not
        # after grpc's default backoff of up to 120 s.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    return options


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _credentials(address: str, config: ClientConfig) -> grpc.ChannelCredentials | None:
    channel_creds = None
    if config.ca_cert:
        read = lambda p: pathlib.Path(p).read_bytes() if p else None
        channel_creds = grpc.ssl_channel_credentials(read(config.ca_cert), read(config.key), read(config.cert))
    if config.token:
        call_creds = grpc.access_token_call_credentials(config.token)
        if channel_creds is None:
            # A bearer token never crosses a network in plaintext: without TLS, loopback only.
            if not _is_loopback(address):
                raise ValueError(f"a token to {address} needs TLS: set ca_cert (plaintext is loopback-only)")
            channel_creds = grpc.local_channel_credentials()
        channel_creds = grpc.composite_channel_credentials(channel_creds, call_creds)
    return channel_creds


def connect(address: str, config: ClientConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address`."""
    config = config or ClientConfig()
    creds = _credentials(address, config)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=_options(config))
    return grpc.aio.secure_channel(address, creds, options=_options(config))


def connect_sync(address: str, config: ClientConfig | None = None) -> grpc.Channel:
    """A blocking channel to `address`."""
    config = config or ClientConfig()
    creds = _credentials(address, config)
    if creds is None:
        return grpc.insecure_channel(address, options=_options(config))
    return grpc.secure_channel(address, creds, options=_options(config))
