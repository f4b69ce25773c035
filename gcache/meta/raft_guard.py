"""A bounded read for pysyncobj connections whose peer has not authenticated yet.

pysyncobj reads a connection until the socket is drained, appending to one bytes buffer, and
parses messages only afterwards; a message's 4-byte length is trusted. So anyone who can reach a
Raft port can make a master buffer as much as they send (104 MiB of zeros raised a master's RSS
by 129 MB) before the first message is even checked.

``GuardedConnection`` changes only the reads of a connection not yet trusted: it buffers at most
``PREAUTH_MAX`` bytes, and closes the connection when the first declared length is larger. A
connection becomes trusted once a message has been decrypted (Fernet: authenticated with the
cluster token) *and* carried the random key this side chose for the connection, so a replayed
first message does not earn trust. After that, pysyncobj behaves exactly as before.

The same class fixes pysyncobj's idle-link timeout: a connection is closed when nothing was
*read* for ``connectionTimeout``, checked when something is sent. Two followers send each
other nothing until an election, so the first vote request after a quiet spell longer than the
timeout closed the link instead of going out, and that failover took a second election round
(0.4-0.5 s instead of 0.15-0.3 s: the first failover of every long-running group).
The check also runs on each poll event, *before* the data that arrived is read, so the receiving
side of that vote request closed the link too. ``GuardedConnection`` counts the silence from the
first send or event after a quiet spell instead, so a peer that answers nothing to what it is
sent still times out, and a quiet link does not.

pysyncobj 0.3.17 creates its connections from module-level ``TcpConnection`` names in
``pysyncobj.tcp_server`` and ``pysyncobj.transport``; ``install()`` points both at this class.
The overridden methods are name-mangled privates of that version, checked at install time, so an
upgrade that renames them fails loudly instead of silently dropping the guard.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any

import pysyncobj.tcp_server
import pysyncobj.transport
from pysyncobj.tcp_connection import TcpConnection

log = logging.getLogger(__name__)

PREAUTH_MAX = 64 << 10  # a handshake message is ~150 bytes
MAX_UNTRUSTED = 32  # incoming connections still authenticating, at most (so at most 2 MiB buffered)
_HEADER = struct.Struct("i")  # pysyncobj's length prefix (native int, as it packs it)
_PRIVATE = ("_TcpConnection__processRead", "_TcpConnection__processParseMessage",
            "_TcpConnection__processConnectionTimeout", "_TcpConnection__readBuffer", "_TcpConnection__lastReadTime",
            "_TcpConnection__timeout",
            "_TcpConnection__recvBufferSize")


class GuardedConnection(TcpConnection):  # type: ignore[misc]  # pysyncobj is untyped
    """See the module docstring. At most MAX_UNTRUSTED accepted connections may be authenticating
    at once; a new one evicts the oldest (a peer's handshake takes one round trip, so churning
    connections cannot keep a real peer out, and idle ones cannot pile up)."""

    trusted = False
    # accepted connections still authenticating, oldest first; class-wide: pysyncobj runs every
    # connection on its one thread
    pending: dict[int, GuardedConnection] = {}  # noqa: RUF012 - deliberately shared

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if kwargs.get("socket") is not None:  # accepted by the Raft port
            pending = GuardedConnection.pending
            while len(pending) >= MAX_UNTRUSTED:
                oldest = next(iter(pending.values()))
                log.warning("Raft port: %d connections still authenticating; closing the oldest", len(pending))
                oldest.disconnect()
                pending.pop(id(oldest), None)
            pending[id(self)] = self

    _last_event = 0.0  # monotonic time of the last check (pysyncobj checks at every send and poll event)

    def _TcpConnection__processConnectionTimeout(self) -> None:
        now = time.monotonic()  # pysyncobj's monotonicTime is time.monotonic
        if now - self._last_event > self._TcpConnection__timeout:
            # nothing happened on this link for longer than the timeout (an idle follower-to-
            # follower link): silence from the peer proves nothing; count it from now on
            self._TcpConnection__lastReadTime = now
        self._last_event = now
        TcpConnection._TcpConnection__processConnectionTimeout(self)

    def _settle(self) -> None:
        GuardedConnection.pending.pop(id(self), None)

    def _TcpConnection__processRead(self) -> bool:
        if self.trusted:
            return bool(TcpConnection._TcpConnection__processRead(self))
        room = PREAUTH_MAX - len(self._TcpConnection__readBuffer)
        if room <= 0:
            return False  # parse what is buffered first (it holds a complete message: see below)
        size: int = getattr(self, "_TcpConnection__recvBufferSize")  # noqa: B009 - a name-mangled private
        self._TcpConnection__recvBufferSize = min(size, room)
        try:
            return bool(TcpConnection._TcpConnection__processRead(self))
        finally:
            self._TcpConnection__recvBufferSize = size

    def _TcpConnection__processParseMessage(self) -> Any:  # pysyncobj message (unpickled)
        if not self.trusted:
            buf = self._TcpConnection__readBuffer
            if len(buf) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buf)
                if not 0 < length <= PREAUTH_MAX - _HEADER.size:
                    log.warning("Raft port: an unauthenticated peer announced a %d-byte message; closing", length)
                    self.disconnect()
                    return None
        had_key = self.recvRandKey is not None
        message = TcpConnection._TcpConnection__processParseMessage(self)
        if message is not None and had_key and self.encryptor is not None:
            self.trusted = True
            self._settle()
        return message

    def connect(self, host: str, port: int) -> bool:
        self.trusted = False
        return bool(super().connect(host, port))

    def disconnect(self) -> None:
        self.trusted = False
        self._settle()
        super().disconnect()


def install() -> None:
    """Make pysyncobj create GuardedConnection for incoming and outgoing connections."""
    missing = [name for name in _PRIVATE[:3] if not hasattr(TcpConnection, name)]
    probe = TcpConnection(poller=None)
    missing += [name for name in _PRIVATE[3:] if not hasattr(probe, name)]
    if missing:
        raise RuntimeError(f"pysyncobj's TcpConnection changed (no {', '.join(missing)}): the Raft port guard "
                           "needs updating for this pysyncobj version")
    pysyncobj.tcp_server.TcpConnection = GuardedConnection
    pysyncobj.transport.TcpConnection = GuardedConnection
