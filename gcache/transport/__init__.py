"""Carriers of the data-plane protocol, and the registry that picks one.

``Transport`` is what ``gcache.Client(transport=...)`` takes. :func:`open_connection` dials a
daemon over the chosen carrier (TCP, the local Unix socket, UCX, or in-memory) and returns an
authenticated :class:`Connection`. Importing this package loads no transport library
(``gcache.transport.ucx`` imports ucxx only when it is used).
"""

from __future__ import annotations

import enum
import socket
import time
from collections.abc import Callable
from typing import Any

from gcache.errors import CallTimeout, ConnectionFailed, GCacheError, ServerError
from gcache.net.address import split_host_port, unix_name
from gcache.net.stream import PolledSocketStream, SocketStream, Stream
from gcache.net.wire import tune
from gcache.protocol import Op
from gcache.transport.connection import Connection


class Transport(enum.Enum):
    """How a client reaches daemons: TCP (the default; the local shared-memory path still applies
    to daemons on this host), UCX (the same protocol carried by UCX tag messages, after a
    worker-address exchange over the TCP data-plane connection; daemons need ``--ucx``), or
    MEMORY (daemons served in this process through gcache.transport.memory; for tests)."""

    TCP = "tcp"
    UCX = "ucx"
    MEMORY = "memory"


# A dialer opens a connected, authenticated stream to ``address``: (address, timeout_s, greet) ->
# Stream, where greet(stream) authenticates a stream and returns a call function for further
# set-up requests on it.
Greet = Callable[[Stream], Callable[[Op, dict[str, Any]], dict[str, Any]]]
Dialer = Callable[[str, float, Greet], Stream]


def _tcp_socket(address: str, timeout_s: float) -> socket.socket:
    sock = socket.create_connection(split_host_port(address), timeout=timeout_s)
    tune(sock)
    return sock


def _greeted(stream: Stream, greet: Greet) -> Stream:
    """``stream`` once ``greet`` authenticated it; closed if that fails."""
    try:
        greet(stream)
    except BaseException:
        stream.close()
        raise
    return stream


def _dial_tcp(address: str, timeout_s: float, greet: Greet) -> Stream:
    return _greeted(PolledSocketStream(_tcp_socket(address, timeout_s)), greet)


def _dial_unix(address: str, timeout_s: float, greet: Greet) -> Stream:
    """The local path: the abstract Unix socket beside the daemon's TCP port ``address``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(unix_name(address))
    except OSError:
        sock.close()
        raise
    return _greeted(PolledSocketStream(sock), greet)


def _dial_ucx(address: str, timeout_s: float, greet: Greet) -> Stream:
    from gcache.transport import ucx

    tcp = SocketStream(_tcp_socket(address, timeout_s))  # the set-up channel, then the liveness channel
    try:
        call = greet(tcp)
        try:
            return ucx.dial(tcp, address, call)
        except ServerError as exc:
            raise ConnectionError(f"daemon refused UCX ({exc}); is it running with --ucx?") from None
        except GCacheError:
            raise
        except Exception as exc:  # noqa: BLE001 - ImportError or one of ucxx's own errors
            raise ConnectionError(f"UCX set-up failed: {type(exc).__name__}: {exc}") from None
    except BaseException:
        tcp.close()
        raise


def _dial_memory(address: str, timeout_s: float, greet: Greet) -> Stream:
    from gcache.transport import memory

    return _greeted(memory.dial(address), greet)


_DIALERS: dict[tuple[Transport, bool], Dialer] = {
    (Transport.TCP, False): _dial_tcp,
    (Transport.TCP, True): _dial_unix,
    (Transport.UCX, False): _dial_ucx,
    (Transport.MEMORY, False): _dial_memory,
}


def register(transport: Transport, local: bool, dialer: Dialer) -> None:
    """Install (or replace) the dialer for ``transport`` (``local``: its same-host path)."""
    _DIALERS[(transport, local)] = dialer


def open_connection(node: str, address: str, timeout_s: float, token: str | None,
                    transport: Transport = Transport.TCP, local: bool = False,
                    check_node: bool = False) -> Connection:
    """An authenticated Connection to the daemon ``node`` at ``address`` over ``transport``
    (``local``: its same-host path, the Unix socket). With ``check_node`` (the caller routes by
    node ids, e.g. a membership from the masters) the daemon's HELLO reply must name ``node``,
    whichever dialer carried it: every dialer greets through the same handshake. Typed errors:
    ConnectionFailed (also: another node answered), CallTimeout, ServerError (e.g. a wrong token)."""
    dialer = _DIALERS.get((transport, local))
    if dialer is None:
        raise ConnectionFailed(node, f"no {transport.value}{' local' if local else ''} transport")
    deadline = time.monotonic() + timeout_s
    greeted: list[bool] = []

    def greet(stream: Stream) -> Callable[[Op, dict[str, Any]], dict[str, Any]]:
        setup = Connection(node, address, stream, timeout_s)
        setup.hello(token, deadline, check_node)
        greeted.append(True)
        return lambda op, meta: setup.call(op, meta, deadline)

    try:
        stream = dialer(address, timeout_s, greet)
    except GCacheError:
        raise
    except TimeoutError:
        raise CallTimeout(node, timeout_s) from None
    except (OSError, ValueError, ConnectionError) as exc:
        raise ConnectionFailed(node, str(exc) or type(exc).__name__) from None
    if check_node and not greeted:  # a dialer that skipped the handshake: which daemon this is is unknown
        stream.close()
        raise ConnectionFailed(node, f"the {transport.value} dialer did not greet {address}; node id not checked")
    return Connection(node, address, stream, timeout_s)


__all__ = ["Connection", "ServerError", "Transport", "open_connection", "register"]
