"""HOST:PORT addresses, what counts as this host, and the local path's Unix socket name."""

from __future__ import annotations

import socket

LOOPBACK_NAMES = ("localhost", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")  # bind every interface


def split_host_port(address: str, what: str = "address") -> tuple[str, int]:
    """``"HOST:PORT"`` -> (HOST, PORT); ``[v6]:PORT`` loses its brackets. ValueError naming
    ``what`` when the address is not HOST:PORT with a port in 0..65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def host_of(address: str) -> str:
    """The HOST of ``"HOST:PORT"`` (everything before the last colon, brackets removed)."""
    return address.rpartition(":")[0].strip("[]")


def is_wildcard(host: str) -> bool:
    """Whether binding HOST binds every interface (``0.0.0.0``, ``::``, ``*`` or no host)."""
    return host.strip("[]") in WILDCARD_HOSTS


def binds_clash(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether listening on (HOST, PORT) ``a`` and ``b`` at once would fail: one port (not 0,
    which picks a free one) on one host, or on any host when either binds every interface."""
    (ha, pa), (hb, pb) = a, b
    return pa == pb != 0 and (ha.strip("[]") == hb.strip("[]") or is_wildcard(ha) or is_wildcard(hb))


def is_loopback(host: str) -> bool:
    """Whether HOST is a loopback name or address."""
    return host in LOOPBACK_NAMES or host.startswith("127.")


def is_local_host(host: str) -> bool:
    """Whether HOST names this machine (loopback, or one of its own addresses)."""
    if is_loopback(host):
        return True
    try:
        return host in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def unix_name(tcp_address: str) -> str:
    """The abstract Unix socket name of the local path of the daemon listening on ``tcp_address``."""
    return f"\0gcache/{tcp_address}"
