"""UCX contexts, workers and endpoints, and the set-up of a UCX connection at either end.

The client dials the daemon over TCP, authenticates (HELLO), and sends UCX_CONNECT with its
worker address and a connection id; the daemon answers with its own worker's address; both
create an endpoint to the other and talk through a :class:`UcxStream` from then on, keeping the
TCP connection open as the liveness channel.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

from gcache.net.address import host_of, is_loopback
from gcache.net.stream import Stream
from gcache.protocol import Op
from gcache.transport.ucx.stream import UcxStream, lib

log = logging.getLogger(__name__)
_lock = threading.Lock()
_contexts: dict[tuple[Any, ...], Any] = {}
_SHM_TLS = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"}

# One request over the set-up stream: (op, metadata) -> the reply's metadata.
Call = Callable[[Op, dict[str, Any]], dict[str, Any]]


def _context(host: str) -> Any:
    """The process's UCX context for peers at ``host`` (one per UCX_TLS / UCX_NET_DEVICES setting).

    Unless UCX_NET_DEVICES says otherwise, a loopback peer restricts UCX to the ``lo`` device, so
    the TCP transport's own listening sockets bind 127.0.0.1 only. TCP segments default to 256 KiB
    (measured over loopback: 2-4 GB/s instead of 1.1-1.5 GB/s with UCX's defaults)."""
    ucx, _ = lib()
    cfg = {}
    if "UCX_NET_DEVICES" not in os.environ and is_loopback(host):
        cfg["NET_DEVICES"] = "lo"
    for name in ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"):
        if "UCX_" + name not in os.environ:
            cfg[name] = "256K"
    key = (os.environ.get("UCX_TLS"), os.environ.get("UCX_NET_DEVICES"), tuple(sorted(cfg.items())))
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = ucx.UCXContext(config_dict=cfg, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        return ctx


def worker_for(host: str) -> Any:
    """A new UCX worker for peers at ``host`` (blocking progress mode); raises when UCX cannot
    be used here."""
    ucx, _ = lib()
    worker = ucx.UCXWorker(_context(host))
    worker.init_blocking_progress_mode()
    return worker


# A worker address is ~50 bytes here, a few KiB on a host with many NICs and transports; UCX
# parses one it is given with assertions, not checks.
MIN_ADDRESS_BYTES, MAX_ADDRESS_BYTES = 8, 64 << 10
ADDRESS_VERSIONS = (0, 1)  # UCP_OBJECT_VERSION_V1 / _V2 in the low bits of the first byte


def address_error(peer: bytes) -> str | None:
    """Why ``peer`` cannot be a UCX worker address (None: it may be one). UCX aborts the whole
    process on an address whose layout version it does not know (``address.c: Assertion
    *addr_version == UCP_OBJECT_VERSION_V2 failed``: one UCX_CONNECT with the single byte 0x02
    killed a daemon); both versions it writes (UCX_ADDRESS_VERSION=v1 / v2) are accepted."""
    if not MIN_ADDRESS_BYTES <= len(peer) <= MAX_ADDRESS_BYTES:
        return f"a worker address of {len(peer)} bytes (expected {MIN_ADDRESS_BYTES}-{MAX_ADDRESS_BYTES})"
    if peer[0] & 0x0F not in ADDRESS_VERSIONS:
        return f"a worker address of unknown layout version {peer[0] & 0x0F}"
    return None


def endpoint(worker: Any, host: str, peer: bytes) -> Any:
    """An endpoint to the worker at ``peer`` (ValueError when it cannot be an address). With error
    handling where the transports allow it: without it, destroying a TCP endpoint whose peer has
    gone spins (measured: the thread never ends); shared-memory-only endpoints refuse it
    ("Destination is unreachable") and tear down cleanly without it."""
    ucx, _ = lib()
    if err := address_error(peer):
        raise ValueError(err)
    address = ucx.UCXAddress.create_from_buffer(peer)
    tls = {t.strip() for t in str(_context(host).config.get("TLS", "all")).split(",") if t.strip()}
    if tls and tls <= _SHM_TLS:
        return worker.create_endpoint_from_worker_address(address, False)
    try:
        return worker.create_endpoint_from_worker_address(address, True)
    except ucx.UCXUnreachableError:
        return worker.create_endpoint_from_worker_address(address, False)


def available() -> tuple[bool, str]:
    """Whether UCX can be used here, and why not (or what it is)."""
    try:
        import ucxx

        lib()
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native library
        return False, f"ucxx is not importable ({type(exc).__name__}: {exc}); install gcache[ucx] (ucxx-cu12)"
    try:
        worker_for("127.0.0.1").address.tobytes()
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
        return False, f"UCX cannot create a worker here: {type(exc).__name__}: {exc}"
    return True, (f"ucxx {ucxx.__version__}, UCX {getattr(ucxx, '__ucx_version__', '?')}, "
                  f"UCX_TLS={os.environ.get('UCX_TLS', 'all')}")




def dial(stream: Stream, address: str, call: Call) -> UcxStream:
    """Turn an authenticated TCP ``stream`` to the daemon at ``address`` into a UCX stream:
    UCX_CONNECT over it (``call``), then an endpoint to the daemon's worker. The TCP stream
    becomes the liveness channel. Raises ConnectionError (or the call's own errors)."""
    host = host_of(address)
    worker = worker_for(host)
    cid = secrets.randbits(62)
    reply = call(Op.UCX_CONNECT, {"addr": worker.address.tobytes(), "cid": cid})
    peer = reply.get("addr")
    if not isinstance(peer, bytes):
        raise ConnectionError("UCX_CONNECT reply without a worker address")
    try:
        ep = endpoint(worker, host, peer)
    except ValueError as exc:  # checked before UCX parses it: a bad one would abort this process
        raise ConnectionError(f"UCX_CONNECT reply: {exc}") from None
    return UcxStream(worker, ep, 2 * cid, 2 * cid + 1, stream)


def accept(stream: Stream, host: str, peer: bytes, cid: int,
           max_staged: int | None = None) -> tuple[UcxStream, bytes]:
    """The daemon's side of UCX_CONNECT on ``stream`` (the TCP connection it came in on): a
    worker and an endpoint to the client's worker ``peer``; returns the stream and the worker
    address to answer with. ``max_staged``: UcxStream's bound on a message staged whole."""
    worker = worker_for(host)
    ep = endpoint(worker, host, peer)
    return UcxStream(worker, ep, 2 * cid + 1, 2 * cid, stream, max_staged), worker.address.tobytes()
