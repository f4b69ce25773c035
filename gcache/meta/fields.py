"""Checks of the fields of requests to a master (gRPC calls and UDP heartbeats).

Every field ends up in the node table, the Raft log, a relayed heartbeat or an error message, so
a bad one is refused with a reason before it gets there. Each check returns what is wrong (None:
nothing). Bools are not ints here (msgpack keeps them apart; Python's isinstance does not), and a
message that may quote the caller is cut to MAX_MESSAGE characters.
"""

from __future__ import annotations

from typing import Any

MAX_NODE_ID = 255  # characters
MAX_INT = 1 << 63
MAX_MESSAGE = 300  # characters of an error message (it may quote the caller)


def cut(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters, for an error message (gRPC sends its details as a
    header: one over the peer's header limit turns the answer into RESOURCE_EXHAUSTED)."""
    return text if len(text) <= limit else text[:limit] + "..."


def node_error(value: Any, name: str = "node") -> str | None:
    """Why ``value`` cannot be a node id: 1..MAX_NODE_ID printable ASCII characters without spaces
    (an id is printed in tables and logs: a newline forged a row of `gcache status`, and escape
    sequences reached the operator's terminal)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NODE_ID or not all("!" <= c <= "~" for c in value):
        return f"'{name}' must be 1..{MAX_NODE_ID} printable ASCII characters without spaces"
    return None


def int_error(req: dict[str, Any], name: str, lo: int, hi: int, required: bool = True) -> str | None:
    """``req[name]`` is an int (not a bool) in lo..hi-1 (or absent, when not ``required``)."""
    if name not in req and not required:
        return None
    value = req.get(name)
    if type(value) is not int or not lo <= value < hi:
        return f"'{name}' must be an int in {lo}..{hi - 1}"
    return None


def flag_error(req: dict[str, Any], name: str) -> str | None:
    """``req[name]``, when present, is a bool (or 0 / 1)."""
    value = req.get(name, False)
    if type(value) is bool or (type(value) is int and value in (0, 1)):
        return None
    return f"'{name}' must be true or false"


def heartbeat_error(req: dict[str, Any]) -> str | None:
    """A heartbeat's fields (the Heartbeat RPC's, and a datagram's but its ``v`` and ``seq``)."""
    return (node_error(req.get("node")) or int_error(req, "inc", 0, MAX_INT)
            or int_error(req, "epoch", -1, MAX_INT, required=False))
