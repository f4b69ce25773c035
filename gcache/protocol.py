"""Data-plane wire format, version 1.

A frame is a fixed header, msgpack metadata, then raw payload bytes::

    magic  b"GCP1"  4 bytes
    version         u8      (1)
    opcode          u8      (Op)
    flags           u16     (reply bit, error bit)
    request id      u64     (echoed in the reply; lets a connection pipeline requests)
    meta length     u32     (msgpack map, at most MAX_META_BYTES; PRE_AUTH_META_BYTES before HELLO)
    payload length  u64     (raw value bytes, concatenated in key order)

Batch requests carry ``{"ns": str, "keys": [bytes, ...]}`` plus per-op fields; replies carry
``{"st": [status, ...]}`` with one :class:`Status` per key, plus per-op fields. A reply with the
ERROR flag carries ``{"code": int, "msg": str}`` and refuses the whole request.

With a master, requests carry the client's membership epoch ``"ep"`` and replies the daemon's;
a daemon answers NOT_OWNER for a key it does not own when the client's epoch is older than its
own (``"fb": 1`` marks a deliberate fallback read from a previous owner during a handover).
Membership extras: a PUT with ``"ho"`` (the sending node's id; 1 from older daemons) carries a
previous owner's handover copies (stored only where no client wrote or deleted the key; it must
carry the ``"ep"`` whose ring it was sent by, and is refused whole when that predates the
receiver's registration, or changes of the ring the receiver missed, or when the receiver has no
handover open that the sender is part of); GET/LGET/EXISTS replies may list in ``"tomb"`` the
positions of misses that are final (no fallback); a PING may carry ``"ep"`` (a newer epoch exists)
or ``"probe": 1`` (answer ``"lead"``: do you reach the master leader?). See docs/faults.md.

CLEAR ``{"ns": str}`` deletes every key of one namespace that the daemon holds, owned or not (RAM,
queued for the disk, on disk), each as a DELETE would; the reply ``{"n": int}`` counts the keys
deleted (0 for a namespace it holds nothing of). A client clears a namespace by sending it to
every daemon of the membership; a daemon that did not answer keeps its keys. A daemon from
before CLEAR refuses it (UNKNOWN_OP). A CLEAR whose client gave up stops, as a write is dropped
(what it deleted by then stays deleted).

A client that gives up on a request resets the connection (or closes it). A write (PUT, DELETE,
LCOMMIT) still unlanded when its connection is shut down, closed or reset is dropped, so a client
must keep its sending side open until it has a write's answer (no half-close).
"""

from __future__ import annotations

import enum
import re
import struct
from typing import Any

import msgpack

MAGIC = b"GCP1"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIQ")
HEADER_SIZE = HEADER.size  # 28
OP_OFFSET = struct.calcsize("<4sB")  # the opcode's byte in a header: after the magic and the version
MAX_META_BYTES = 16 << 20
PRE_AUTH_META_BYTES = 4096  # a HELLO's metadata, the only frame a daemon with a token reads before it
MAX_META_MAP_LEN = 64  # fields of one map in request metadata
MAX_META_STR_BYTES = 64 << 10  # one string or byte string in request metadata (keys: MAX_KEY_BYTES)
MAX_KEY_BYTES = 1024
MAX_NS_BYTES = 128
MAX_BATCH_KEYS = 65536
DEFAULT_MAX_VALUE_BYTES = 64 << 20  # a daemon's default --max-value: larger values are refused TOO_LARGE

FLAG_REPLY = 0x1
FLAG_ERROR = 0x2
FLAG_NOREPLY = 0x4  # request: do not answer (LDONE of a copy the client already validated)


class Op(enum.IntEnum):
    PING = 1
    PUT = 2
    GET = 3
    EXISTS = 4
    DELETE = 5
    STATS = 6
    HELLO = 7  # {"token": str}: first request on a connection when the cluster has a token
    # Local shared-memory path (Unix socket only; see gcache.server.local):
    LMAP = 8  # reply carries the arena's memfd (SCM_RIGHTS) and {"size", "id"}
    LGET = 9  # pin values, reply their arena offsets under a lease
    LDONE = 10  # release leases; reply whether each was still held (copy valid)
    LALLOC = 11  # reserve slots, reply their offsets under a lease
    LCOMMIT = 12  # make reserved slots visible (if the lease is still held)
    # UCX transport (TCP connection only, daemon run with --ucx; see gcache.transport.ucx):
    UCX_CONNECT = 13  # {"addr": client worker address, "cid": int}; reply {"addr": daemon's}
    CLEAR = 14  # {"ns": str}: delete every key of the namespace held here; reply {"n": keys deleted}


class Status(enum.IntEnum):
    """Per-key outcome. OK and NOT_FOUND are the normal answers; the rest say why not."""

    OK = 0
    NOT_FOUND = 1
    TOO_LARGE = 2  # value larger than the configured maximum
    FULL = 3  # no room even after eviction (everything pinned or in flight)
    BAD_KEY = 4  # empty or over-long key
    BUFFER_TOO_SMALL = 5  # client side: the caller's buffer cannot hold the value
    UNAVAILABLE = 6  # client side: the owning node failed (only with errors="miss")
    ERROR = 7  # server-side failure for this key (logged by the daemon)
    NOT_OWNER = 8  # the client's membership is stale: this node does not own the key now


class ErrorCode(enum.IntEnum):
    """Whole-request refusals (FLAG_ERROR replies)."""

    BAD_FRAME = 1
    BAD_VERSION = 2
    UNKNOWN_OP = 3
    BAD_META = 4
    TOO_LARGE = 5
    INTERNAL = 6
    AUTH = 7  # missing or wrong cluster token
    FENCED = 8  # the node lost its membership lease (re-registering) or left (drained); treat as unavailable
    BUSY = 9  # the daemon is at its connection cap or metadata budget; retry later


def pack_header(op: int, flags: int, req_id: int, meta_len: int, payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, flags, req_id, meta_len, payload_len)


def unpack_header(buf: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int, int]:
    """Return (version, opcode, flags, request id, meta length, payload length).

    Raises ValueError naming the fault for a bad magic or an oversized metadata length. The
    version is returned, not checked, so the caller can answer a wrong version clearly.
    """
    magic, version, op, flags, req_id, meta_len, payload_len = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ValueError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if meta_len > MAX_META_BYTES:
        raise ValueError(f"metadata of {meta_len} bytes exceeds {MAX_META_BYTES}")
    return version, op, flags, req_id, meta_len, payload_len


def encode_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def decode_meta(raw: bytes | memoryview) -> dict[str, Any]:
    """Decode request/reply metadata; raises ValueError for anything but a msgpack map."""
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_META_BYTES)
    except Exception as exc:  # noqa: BLE001  (msgpack raises several unrelated types)
        raise ValueError(f"undecodable metadata: {_why_undecodable(exc)}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"metadata must be a map, got {type(meta).__name__}")  # noqa: TRY004  (callers catch ValueError for every bad frame)
    return meta


_LIMIT = re.compile(r"^(\d+) exceeds max_(map|array|str|bin|ext)_len\((\d+)\)$")
_LIMIT_UNITS = {"map": "fields in one map", "array": "items in one array", "str": "bytes in one string",
                "bin": "bytes in one byte string", "ext": "bytes of an ext type"}


def _why_undecodable(exc: Exception) -> str:
    """What was wrong with metadata msgpack refused, in words (several of its exceptions have
    no message at all)."""
    if isinstance(exc, msgpack.StackError):
        return "nested too deep (more levels than msgpack decodes)"
    if isinstance(exc, msgpack.ExtraData):
        return f"{len(getattr(exc, 'extra', b''))} stray bytes after the msgpack map"
    if isinstance(exc, msgpack.FormatError):
        return "not msgpack (a byte that starts no msgpack value)"
    text = str(exc)
    if m := _LIMIT.match(text):
        n, kind, limit = m.groups()
        if kind == "ext":
            return "ext types are not allowed"
        return f"too large: {n} {_LIMIT_UNITS[kind]}, at most {limit}"
    if "incomplete input" in text:
        return "truncated msgpack (the metadata ends inside a value)"
    return text or f"not msgpack ({type(exc).__name__})"


_REQUEST_LIMITS: dict[str, Any] = {
    "raw": False, "strict_map_key": True, "max_map_len": MAX_META_MAP_LEN, "max_array_len": MAX_BATCH_KEYS,
    "max_str_len": MAX_META_STR_BYTES, "max_bin_len": MAX_META_STR_BYTES, "max_ext_len": 0,
}


def decode_request_meta(raw: bytes | memoryview, max_items: int | None = None) -> dict[str, Any]:
    """Decode a request's metadata under limits, so hostile metadata cannot make the daemon
    build more Python objects than a real request needs: at most MAX_META_MAP_LEN fields per
    map, MAX_BATCH_KEYS items per array, MAX_META_STR_BYTES per string, and (``max_items``)
    that many array items and map fields in all. Raises ValueError naming the limit."""
    hooks = _REQUEST_LIMITS
    if max_items is not None:
        left = [max_items]

        def count(obj: Any) -> Any:
            left[0] -= len(obj)
            if left[0] < 0:
                raise ValueError(f"more than {max_items} items in all")
            return obj

        hooks = {**_REQUEST_LIMITS, "list_hook": count, "object_hook": count}
    try:
        meta = msgpack.unpackb(raw, **hooks)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ValueError(f"undecodable metadata: {_why_undecodable(exc)}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"metadata must be a map, got {type(meta).__name__}")  # noqa: TRY004 - bad input
    return meta


def key_error(key: object) -> str | None:
    """Why ``key`` is not a valid key, or None if it is."""
    if not isinstance(key, bytes):
        return f"key must be bytes, got {type(key).__name__}"
    if not key:
        return "empty key"
    if len(key) > MAX_KEY_BYTES:
        return f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}"
    return None


def namespace_error(ns: object) -> str | None:
    if not isinstance(ns, str):
        return f"namespace must be a string, got {type(ns).__name__}"
    if not ns or len(ns.encode()) > MAX_NS_BYTES:
        return f"namespace must be 1..{MAX_NS_BYTES} bytes"
    return None
