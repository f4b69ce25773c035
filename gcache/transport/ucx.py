"""The data-plane protocol over UCX (ucxx from PyPI), selected with ``Client(transport=Transport.UCX)``
and ``gcache daemon --ucx``.

Connection set-up reuses the daemon's TCP data-plane connection, so nothing listens on any other
interface (ucxx's listener API binds every interface): the client connects over TCP (HELLO with
the token as usual), sends UCX_CONNECT ``{"addr": its worker address, "cid": connection id}``;
the daemon creates a UCX worker for this connection, an endpoint to the client's worker, and
answers with its own worker address; the client creates its endpoint back. From then on frames
flow as UCX tag messages (tags ``2*cid`` client->daemon, ``2*cid+1`` daemon->client): the header
and metadata as one message, each payload buffer as its own, received straight into its
destination (the arena slot on the daemon, the caller's buffer on the client).

The TCP connection stays open, idle, as the liveness channel: either side closing it (or dying,
or the daemon stopping) wakes the other side's waits, which UCX itself would not report with
endpoint error handling off (required for shared-memory-only endpoints, see FACTS.md).

Both sides see a socket-like object (:class:`UcxSocket`: recv_into / sendmsg / settimeout ...), so
the daemon's Handler and the client's Connection run unchanged over it. A message larger than the
bytes asked for (the receiver reads the 28-byte header first, then the metadata) is received into
a staging buffer and handed out in pieces; payload messages land in place. Each connection owns
its own UCX worker (one thread uses it at a time), progressed in blocking mode: progress, arm,
then poll the worker's event fd together with the TCP socket.
"""

from __future__ import annotations

import io
import logging
import math
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gcache.protocol import ErrorCode, Op

if TYPE_CHECKING:
    from gcache.client.connection import Connection
    from gcache.server.handler import Handler
    from gcache.server.server import DataServer

log = logging.getLogger(__name__)
_lock = threading.Lock()
_contexts: dict[tuple, Any] = {}
_SHM_TLS = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"}
_EVENTS = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def _lib() -> tuple[Any, Any]:
    """(ucxx's libucxx module, its Array class); raises ImportError when ucxx is missing."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as lib
    from ucxx._lib.arr import Array

    return lib, Array


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _context(host: str) -> Any:
    """The process's UCX context for peers at ``host`` (one per UCX_TLS / UCX_NET_DEVICES setting).

    Unless UCX_NET_DEVICES says otherwise, a loopback peer restricts UCX to the ``lo`` device, so
    the TCP transport's own listening sockets bind 127.0.0.1 only. TCP segments default to 256 KiB
    (FACTS.md: 2-4 GB/s instead of 1.1-1.5 with UCX's defaults)."""
    lib, _ = _lib()
    cfg = {}
    if "UCX_NET_DEVICES" not in os.environ and _is_loopback(host):
        cfg["NET_DEVICES"] = "lo"
    for name in ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"):
        if "UCX_" + name not in os.environ:
            cfg[name] = "256K"
    key = (os.environ.get("UCX_TLS"), os.environ.get("UCX_NET_DEVICES"), tuple(sorted(cfg.items())))
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = lib.UCXContext(config_dict=cfg, feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
        return ctx


def _worker(host: str) -> Any:
    lib, _ = _lib()
    worker = lib.UCXWorker(_context(host))
    worker.init_blocking_progress_mode()
    return worker


def _endpoint(worker: Any, host: str, peer: bytes) -> Any:
    """An endpoint to the worker at ``peer``. With error handling where the transports allow it:
    without it, destroying a TCP endpoint whose peer has gone spins (measured: the thread never
    ends); shared-memory-only endpoints refuse it ("Destination is unreachable") and tear down
    cleanly without it."""
    lib, _ = _lib()
    address = lib.UCXAddress.create_from_buffer(peer)
    tls = {t.strip() for t in str(_context(host).config.get("TLS", "all")).split(",") if t.strip()}
    if tls and tls <= _SHM_TLS:
        return worker.create_endpoint_from_worker_address(address, False)
    try:
        return worker.create_endpoint_from_worker_address(address, True)
    except lib.UCXUnreachableError:
        return worker.create_endpoint_from_worker_address(address, False)


def available() -> tuple[bool, str]:
    """Whether UCX can be used here, and why not (or what it is)."""
    try:
        import ucxx

        _lib()
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native library
        return False, f"ucxx is not importable ({type(exc).__name__}: {exc}); install gcache[ucx] (ucxx-cu12)"
    try:
        _worker("127.0.0.1").address.tobytes()
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
        return False, f"UCX cannot create a worker here: {type(exc).__name__}: {exc}"
    return True, (f"ucxx {ucxx.__version__}, UCX {getattr(ucxx, '__ucx_version__', '?')}, "
                  f"UCX_TLS={os.environ.get('UCX_TLS', 'all')}")


class UcxSocket:
    """The subset of the socket API that gcache's Handler and Connection use, over one UCX endpoint.

    ``watch`` is the TCP connection the endpoint was set up over; it carries nothing more, and
    its becoming readable (EOF, reset, shutdown) means the peer is gone. Not pollable: clients
    drive these connections synchronously (``pollable`` is False)."""

    pollable = False

    def __init__(self, worker: Any, ep: Any, send_tag: int, recv_tag: int, watch: socket.socket) -> None:
        lib, self._Array = _lib()
        self._w, self._ep = worker, ep
        self._stag, self._rtag = lib.UCXXTag(send_tag), lib.UCXXTag(recv_tag)
        self._watch = watch
        self._wfd = watch.fileno()
        self._poller = select.poll()
        self._poller.register(worker.epoll_file_descriptor, select.POLLIN)
        self._poller.register(self._wfd, _EVENTS)
        self._timeout: float | None = None
        self._rest: memoryview | None = None  # staged bytes of a message not yet handed out
        self._posted: list = []  # sends posted in non-blocking mode: (request, array) pairs
        self._closed = False

    def __repr__(self) -> str:
        return f"UcxSocket(peer={self._peer()}, closed={self._closed})"

    # -- socket API ---------------------------------------------------------------------------
    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool) -> None:
        """Non-blocking mode only changes sendmsg: it posts the messages and returns at once; the
        next blocking call (or wait_readable) completes them, so the buffers must stay untouched."""
        self._timeout = None if flag else 0.0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = _bytes_view(buffer)
        if nbytes:
            view = view[:nbytes]
        if not len(view):
            return 0
        if self._rest is not None:
            n = min(len(view), len(self._rest))
            view[:n] = self._rest[:n]
            self._rest = self._rest[n:] if n < len(self._rest) else None
            return n
        deadline = self._deadline()
        self._finish_posted(deadline)
        try:
            info = self._until(self._probe, deadline)
        except ConnectionResetError:
            return 0  # the peer closed: EOF, as a socket would say
        size = info.length
        if size <= len(view):  # the common case: straight into the destination
            self._complete([self._w.tag_recv_with_handle(self._Array(view[:size]), info)], deadline)
            return size
        stage = memoryview(bytearray(size))
        self._complete([self._w.tag_recv_with_handle(self._Array(stage), info)], deadline)
        view[:] = stage[: len(view)]
        self._rest = stage[len(view):]
        return len(view)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        buf = bytearray(bufsize)
        return bytes(buf[: self.recv_into(buf)])

    def sendmsg(self, buffers: Any, ancdata: Any = (), flags: int = 0, address: Any = None) -> int:
        """Send each non-empty buffer as one tag message; returns when all have left their buffers."""
        if ancdata:
            raise io.UnsupportedOperation("no ancillary data over UCX")
        arrays, reqs, total = [], [], 0
        for b in buffers:
            view = _bytes_view(b)
            if not len(view):
                continue
            arr = self._Array(view)
            arrays.append(arr)  # alive until the send completes
            reqs.append(self._ep.tag_send(arr, self._stag))
            total += len(view)
        if self._timeout == 0.0:
            self._posted += zip(reqs, arrays)
            return total
        deadline = self._deadline()
        self._finish_posted(deadline)
        self._complete(reqs, deadline)
        return total

    def sendall(self, data: Any, flags: int = 0) -> None:
        self.sendmsg([data])

    def send(self, data: Any, flags: int = 0) -> int:
        return self.sendmsg([data])

    def getpeername(self) -> Any:
        return self._watch.getpeername()

    def shutdown(self, how: int) -> None:
        self._watch.shutdown(how)  # wakes any wait on this connection, here and at the peer

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cancel()
        try:
            self._ep.close()
        except Exception:
            log.debug("closing a UCX endpoint failed", exc_info=True)
        self._ep = self._w = None
        self._watch.close()

    @staticmethod
    def wait_readable(socks: list[UcxSocket], deadline: float) -> list[UcxSocket]:
        """Those of ``socks`` with a reply to read (or whose peer is gone), waiting until one is or
        the deadline passes (then []). Lets a caller read replies in the order they arrive."""
        poller = select.poll()
        for s in socks:
            poller.register(s._w.epoll_file_descriptor, select.POLLIN)
            poller.register(s._wfd, _EVENTS)
        while True:
            ready = [s for s in socks if s._readable()]
            if ready:
                return ready
            if not all(s._w.arm() for s in socks):
                continue
            wait_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if wait_ms <= 0:
                return []
            poller.poll(wait_ms)

    def _readable(self) -> bool:
        if self._rest is not None or self._closed:
            return True
        while self._w.progress_once():
            pass
        if self._w.tag_probe(self._rtag).matched:
            return True
        return any(fd == self._wfd for fd, _ev in self._poller.poll(0))

    def idle_ok(self) -> bool:
        """An idle connection has nothing to read and its peer is still there."""
        if self._closed:
            return False
        if any(fd == self._wfd for fd, _ev in self._poller.poll(0)):
            return False
        self._w.progress()
        return not self._w.tag_probe(self._rtag).matched and self._rest is None

    # -- internals ----------------------------------------------------------------------------
    def _deadline(self) -> float | None:
        if self._closed:
            raise OSError("connection closed")
        return None if self._timeout is None else time.monotonic() + self._timeout

    def _probe(self) -> Any:
        info = self._w.tag_probe(self._rtag, remove=True)
        return info if info.matched else None

    def _until(self, ready: Callable[[], Any], deadline: float | None) -> Any:
        """Progress the worker until ``ready()`` is truthy; blocks in poll when idle. Raises
        socket.timeout past the deadline and ConnectionResetError when the peer is gone."""
        w = self._w
        while True:
            got = ready()
            if got:
                return got
            if w.progress_once():
                continue
            # Sleep in poll only once the worker is armed; when it is not (events pending, or a
            # transport that keeps signalling after its peer went away), just look at the
            # liveness socket and the deadline, so neither can be missed while spinning.
            armed = w.arm()
            wait_ms = -1 if deadline is None else math.ceil((deadline - time.monotonic()) * 1000)
            if deadline is not None and wait_ms <= 0:
                raise TimeoutError("timed out")
            for fd, _ev in self._poller.poll(wait_ms if armed else 0):
                if fd == self._wfd:  # the peer closed, died or we were shut down
                    w.progress()
                    got = ready()
                    if got:
                        return got
                    raise ConnectionResetError(f"UCX peer {self._peer()} closed the connection")

    def _finish_posted(self, deadline: float | None) -> None:
        if self._posted:
            posted, self._posted = self._posted, []
            self._complete([r for r, _arr in posted], deadline)

    def _complete(self, reqs: list, deadline: float | None) -> None:
        if not reqs:
            return
        try:
            self._until(lambda: all(r.completed for r in reqs), deadline)
        except BaseException:
            self._cancel()  # nothing may land in (or leave) the caller's buffers after we return
            raise
        for r in reqs:
            try:
                r.check_error()
            except Exception as exc:  # noqa: BLE001 - ucxx raises its own hierarchy
                raise ConnectionResetError(f"UCX transfer failed: {exc}") from None

    def _cancel(self) -> None:
        try:
            if self._w is not None:
                self._w.cancel_inflight_requests()
        except Exception:
            log.debug("cancelling UCX requests failed", exc_info=True)

    def _peer(self) -> str:
        try:
            host, port = self._watch.getpeername()[:2]
            return f"{host}:{port}"
        except (OSError, ValueError):
            return "?"


def _bytes_view(buf: Any) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# -- daemon side ---------------------------------------------------------------------------------
def install(server: DataServer) -> None:
    """Serve UCX_CONNECT on ``server``'s TCP connections (``gcache daemon --ucx``)."""
    _context(server.host)  # fail at start-up, not at the first client
    server.handler_hooks.append(lambda handler: _enable(handler, server.host))


def _enable(handler: Handler, host: str) -> None:
    handler.extra_ops[Op.UCX_CONNECT] = lambda req_id, meta: _serve(handler, host, req_id, meta)


def _serve(handler: Handler, host: str, req_id: int, meta: dict[str, Any]) -> None:
    """Answer UCX_CONNECT, then serve this client over UCX on this thread until it goes away."""
    from gcache.server.handler import Handler as PlainHandler
    from gcache.server.handler import Refused

    addr, cid = meta.get("addr"), meta.get("cid")
    if not isinstance(addr, bytes) or not isinstance(cid, int) or not 0 <= cid < 1 << 62:
        raise Refused(ErrorCode.BAD_META, "UCX_CONNECT needs 'addr' (worker address bytes) and 'cid' (int)")
    try:
        worker = _worker(host)
        ep = _endpoint(worker, host, addr)
    except Exception as exc:  # noqa: BLE001 - reported to the client
        raise Refused(ErrorCode.INTERNAL, f"UCX endpoint to the client failed: {exc}") from None
    handler._reply(Op.UCX_CONNECT, req_id, {"addr": worker.address.tobytes()})
    sock = UcxSocket(worker, ep, 2 * cid + 1, 2 * cid, handler.sock)
    # the daemon's limits and this connection's admission state carry over to the UCX side
    inner = PlainHandler(sock, handler.store, handler.node_id, handler.max_payload, handler.token, handler.agent,
                         handler.frames.config, handler.frames.budget, handler.state)
    if handler.authed:  # always: UCX_CONNECT is only served after HELLO when a token is set
        inner.mark_authed()
    try:
        inner.serve()
    finally:
        sock._cancel()
        try:  # ends the TCP side too: the client must not keep using a connection we left
            handler.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# -- client side ---------------------------------------------------------------------------------
def connect(node: str, address: str, connect_timeout_s: float, token: str | None = None) -> Connection:
    """A Connection to the daemon at ``address`` whose frames travel over UCX."""
    from gcache.client.connection import Connection
    from gcache.errors import ConnectionFailed, GCacheError, ServerError

    conn = Connection(node, address, connect_timeout_s, token)  # TCP + HELLO: the set-up channel
    try:
        host = address.rpartition(":")[0]
        worker = _worker(host)
        cid = secrets.randbits(62)
        try:
            reply = conn.call(Op.UCX_CONNECT, {"addr": worker.address.tobytes(), "cid": cid},
                              time.monotonic() + connect_timeout_s)
        except ServerError as exc:
            raise ConnectionFailed(node, f"daemon refused UCX ({exc}); is it running with --ucx?") from None
        peer = reply.get("addr")
        if not isinstance(peer, bytes):
            raise ConnectionFailed(node, "UCX_CONNECT reply without a worker address")
        ep = _endpoint(worker, host, peer)
    except GCacheError:
        conn.close()
        raise
    except Exception as exc:  # noqa: BLE001 - ImportError or a UCX error
        conn.close()
        raise ConnectionFailed(node, f"UCX set-up failed: {type(exc).__name__}: {exc}") from None
    conn.sock = UcxSocket(worker, ep, 2 * cid, 2 * cid + 1, conn.sock)  # type: ignore[assignment]
    return conn


__all__ = ["UcxSocket", "available", "connect", "install"]
