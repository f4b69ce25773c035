"""Typed errors. Expected outcomes (miss, full, expired) are per-key statuses, not exceptions.

Transport failures are translated once, at the edge (gcache.transport.connection), into these.
"""

from __future__ import annotations


class GCacheError(Exception):
    """Base of every gcache exception."""


class ConfigError(GCacheError, ValueError):
    """A configuration value is invalid; the message says what to change. ``field``, when
    given, names the setting at fault (a config dataclass's field), so a caller can point at
    the flag or config-file key that set it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ConnectionFailed(GCacheError, ConnectionError):
    """The node could not be reached, or the connection broke mid-call."""

    def __init__(self, node: str, cause: str) -> None:
        super().__init__(f"{node}: {cause}")
        self.node = node


class CallTimeout(GCacheError, TimeoutError):
    """The node did not answer within the call's timeout."""

    def __init__(self, node: str, timeout_s: float) -> None:
        super().__init__(f"{node}: no answer within {timeout_s:.3f}s")
        self.node = node


class ClientForked(GCacheError):
    """A Client used in a process forked from the one that made it. Its connections are the
    parent's too (a reply could reach the other process: another key's bytes); each process
    needs a Client of its own, made after the fork."""

    def __init__(self, made_in: int) -> None:
        super().__init__(f"this Client was made in process {made_in} and cannot be used after a fork (its "
                         "connections are shared with that process); make a new Client in this process")
        self.made_in = made_in


class ClientClosed(GCacheError):
    """A call on a Client after its close()."""

    def __init__(self) -> None:
        super().__init__("this Client is closed")


class ProtocolError(GCacheError):
    """A frame broke the protocol (bad magic, version, lengths or metadata)."""


class ServerError(GCacheError):
    """The server refused the whole request and said why."""

    def __init__(self, node: str, code: int, message: str) -> None:
        super().__init__(f"{node}: {message} (code {code})")
        self.node = node
        self.code = code
        self.message = message
