"""Which addresses stay on this machine."""

import ipaddress
import socket


def split_host(address: str) -> str:
    """The host of 'host:port' ('[::1]:port' -> '::1')."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address ('' and 0.0.0.0 / :: are every interface)."""
    if host == "localhost":
        return True
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def source_address_towards(host: str) -> str:
    """The address of this machine's interface that reaches `host` (the routing table's choice: a UDP socket
    connected to it reports its source address; connect sends no packet)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]
