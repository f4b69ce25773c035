"""HOST:PORT addresses, what counts as this host, and the local path's Unix socket name."""

from __future__ import annotations

import ipaddress
import re
import socket

LOOPBACK_NAMES = ("localhost", "::1")
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def address_error(address: str) -> str | None:
    """Why ``address`` is not a HOST:PORT a node can be reached at (None: it is one): HOST is a
    name or IPv4 address (letters, digits, ``-``, ``.``, ``_``) or a bracketed IPv6 address, PORT
    1-65535 in ASCII digits. The masters refuse a Register with such an address
    (gcache.meta.master), so no membership holds one."""
    host, _, port = address.rpartition(":")
    ok_port = port.isascii() and port.isdigit() and 0 < int(port) <= 65535
    if host.startswith("[") and host.endswith("]"):
        try:
            ok_host = isinstance(ipaddress.ip_address(host[1:-1]), ipaddress.IPv6Address)
        except ValueError:
            ok_host = False
    else:
        ok_host = _HOST_NAME.fullmatch(host) is not None
    if not ok_port or not ok_host:
        return f"address {address!r} is not HOST:PORT (a host name, IPv4 or [IPv6] address, and a port 1-65535)"
    return None


def is_wildcard(host: str) -> bool:
    """Whether HOST means "every interface" (0.0.0.0, ::, an empty host, or a spelling the
    resolver takes for 0.0.0.0 such as "0"): a place to bind, never an address to dial, since
    a client dialling it reaches whatever listens on its own host."""
    host = host.strip("[]")
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        pass
    if not host[0].isdigit():
        return False
    try:
        return socket.inet_aton(host) == b"\0\0\0\0"  # "0", "0.0", "0x0": what bind and connect take
    except OSError:
        return False


def advertised_address_error(address: str) -> str | None:
    """Why ``address`` cannot be the address a daemon is registered at (None: it can):
    address_error's rule, and no wildcard host. The masters refuse a Register with such an
    address, and a daemon refuses to start with one."""
    if err := address_error(address):
        return err
    if is_wildcard(host_of(address)):
        return (f"address {address!r} is a wildcard (every interface), not one a node can be reached at: a "
                "client dialling it reaches its own host (a daemon listening on one needs --advertise HOST[:PORT])")
    return None


def join_host_port(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 HOST in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_advertise(text: str, bound_port: int) -> str:
    """The address a daemon advertises, from ``--advertise HOST`` (the port it bound) or
    ``HOST:PORT``; an IPv6 HOST bare or in brackets. ValueError when it is not one that can be
    registered (advertised_address_error, port 0)."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]")
        if not sep or (port and not port.startswith(":")):
            raise ValueError(f"--advertise {text!r}: expected HOST or HOST:PORT")
        port = port[1:]
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
        if ":" in host:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"--advertise {text!r}: expected HOST or HOST:PORT") from None
    if port and not (port.isascii() and port.isdigit()):
        raise ValueError(f"--advertise {text!r}: expected HOST or HOST:PORT")
    number = int(port) if port else bound_port
    if number == 0:
        raise ValueError(f"--advertise {text!r}: port 0 cannot be reached")
    address = join_host_port(host, number)
    if err := advertised_address_error(address):
        raise ValueError(f"--advertise {text!r}: {err}")
    return address


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
