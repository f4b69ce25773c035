"""A Stream (gcache.net.stream) over one UCX endpoint: tag messages, received in place."""

from __future__ import annotations

import io
import logging
import math
import os
import select
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gcache.net.stream import Stream

log = logging.getLogger(__name__)
_EVENTS = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def lib() -> tuple[Any, Any]:
    """(ucxx's libucxx module, its Array class); raises ImportError when ucxx is missing."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as ucx
    from ucxx._lib.arr import Array

    return ucx, Array


class UcxStream:
    """A Stream over one UCX endpoint.

    ``watch`` is the TCP stream the endpoint was set up over; it carries nothing more, and
    its becoming readable (EOF, reset, shutdown) means the peer is gone. Not pollable: clients
    drive these connections synchronously (``pollable`` is False; see wait_readable)."""

    pollable = False

    def __init__(self, worker: Any, ep: Any, send_tag: int, recv_tag: int, watch: Stream,
                 max_staged: int | None = None) -> None:
        ucx, self._Array = lib()
        self._w, self._ep = worker, ep
        self._stag, self._rtag = ucx.UCXXTag(send_tag), ucx.UCXXTag(recv_tag)
        self._watch = watch
        self._wfd = watch.fileno()
        self._poller = select.poll()
        self._poller.register(worker.epoll_file_descriptor, select.POLLIN)
        self._poller.register(self._wfd, _EVENTS)
        self._timeout: float | None = None
        self._rest: memoryview | None = None  # staged bytes of a message not yet handed out
        # the largest message received into a buffer of its own when the reader's is smaller
        # (None: any): its size is the peer's word, so a daemon bounds it (a 1 GiB PING cost 1 GiB)
        self.max_staged = max_staged
        self._posted: list[tuple[Any, Any]] = []  # sends posted in non-blocking mode: (request, array) pairs
        self._closed = False

    def __repr__(self) -> str:
        return f"UcxStream(peer={self.peer()}, closed={self._closed})"

    # -- socket API ---------------------------------------------------------------------------
    def settimeout(self, timeout: float | None, /) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool, /) -> None:
        """Non-blocking mode only changes sendmsg: it posts the messages and returns at once; the
        next blocking call (or wait_readable) completes them, so the buffers must stay untouched."""
        self._timeout = None if flag else 0.0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int:
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
        return self._take(info, view, deadline)

    def recvmsg_into(self, buffers: Iterable[Any], /) -> tuple[int, list[Any], int, Any]:
        """Scatter read: the next messages, each exactly one buffer's size, are all received at
        once (a receive is posted as soon as its message is announced, so the transfers overlap
        instead of following one another); a message of another size ends the read, taken as
        recv_into would take it. Returns what socket.recvmsg_into does (a short count is fine)."""
        views = [v for v in map(_bytes_view, buffers) if len(v)]
        if self._rest is not None or len(views) < 2:
            return (self.recv_into(views[0]) if views else 0), [], 0, None
        deadline = self._deadline()
        self._finish_posted(deadline)
        reqs: list[Any] = []
        total = 0
        try:
            for view in views:
                try:
                    info = self._until(self._probe, deadline)
                except ConnectionResetError:
                    break  # what was announced is still received; the next read says EOF
                if info.length != len(view):
                    self._complete(reqs, deadline)
                    reqs = []
                    total += self._take(info, view, deadline)
                    break
                reqs.append(self._w.tag_recv_with_handle(self._Array(view), info))
                total += len(view)
            self._complete(reqs, deadline)
        except BaseException:
            self._cancel()  # nothing may land in the caller's buffers after we return
            raise
        return total, [], 0, None

    def _take(self, info: Any, view: memoryview, deadline: float | None) -> int:
        """Receive the announced message ``info`` into ``view``: straight in when it fits, else
        the first len(view) bytes (the rest is kept for the next read)."""
        size = info.length
        if size <= len(view):  # the common case: straight into the destination
            self._complete([self._w.tag_recv_with_handle(self._Array(view[:size]), info)], deadline)
            return size
        if self.max_staged is not None and size > self.max_staged:
            raise ConnectionResetError(f"UCX peer {self.peer()} sent a message of {size} bytes where at most "
                                       f"{self.max_staged} may be staged")
        stage = memoryview(bytearray(size))
        self._complete([self._w.tag_recv_with_handle(self._Array(stage), info)], deadline)
        view[:] = stage[: len(view)]
        self._rest = stage[len(view):]
        return len(view)

    def discard(self, nbytes: int) -> None:
        """Read and drop the next ``nbytes`` (the payload of a refused value): whole messages are
        received truncated into a small buffer (UCX drops their bytes), so a value larger than
        any staging bound is dropped without being staged."""
        deadline = self._deadline()
        while nbytes > 0:
            if self._rest is not None:
                n = min(nbytes, len(self._rest))
                self._rest = self._rest[n:] if n < len(self._rest) else None
                nbytes -= n
                continue
            self._finish_posted(deadline)
            info = self._until(self._probe, deadline)
            if info.length > nbytes:  # a message beyond the bytes to drop: keep its rest, as recv_into would
                self._take(info, memoryview(bytearray(nbytes)), deadline)
                return
            req = self._w.tag_recv_with_handle(self._Array(memoryview(bytearray(1))), info)
            try:
                self._complete([req], deadline)
            except ConnectionResetError as exc:
                if "truncated" not in str(exc).lower():
                    raise
            nbytes -= info.length
            deadline = self._deadline()

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        buf = bytearray(bufsize)
        return bytes(buf[: self.recv_into(buf)])

    def sendmsg(self, buffers: Iterable[Any], ancdata: Any = (), flags: int = 0, address: Any = None, /) -> int:
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

    def fileno(self) -> int:
        return self._wfd  # for identity only: readiness is wait_readable's business

    def peer(self) -> str:
        return self._watch.peer()

    def abort(self) -> None:
        self.close()

    def shutdown(self, how: int, /) -> None:
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
    def wait_readable(socks: Sequence[UcxStream], deadline: float) -> list[UcxStream]:
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

    def hung_up(self) -> bool:
        """The watch connection carries nothing after set-up: readable means the peer is gone."""
        return self._closed or any(fd == self._wfd for fd, _ev in self._poller.poll(0))

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
        TimeoutError past the deadline and ConnectionResetError when the peer is gone."""
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
                    raise ConnectionResetError(f"UCX peer {self.peer()} closed the connection")

    def _finish_posted(self, deadline: float | None) -> None:
        if self._posted:
            posted, self._posted = self._posted, []
            self._complete([r for r, _arr in posted], deadline)

    def _complete(self, reqs: list[Any], deadline: float | None) -> None:
        """Wait for ``reqs``; the deadline (a timeout: settimeout) bounds the wait for the next one
        to complete, not for all of them, as a socket's timeout bounds one blocked call: a slow
        but live peer moves any number of messages."""
        if not reqs:
            return
        try:
            def completed() -> int:
                return sum(r.completed for r in reqs)

            done = completed()
            while done < len(reqs):
                self._until(lambda before=done: completed() > before, deadline)  # type: ignore[misc]
                done = completed()
                if deadline is not None and self._timeout is not None:
                    deadline = time.monotonic() + self._timeout
        except BaseException:
            self._cancel()  # nothing may land in (or leave) the caller's buffers after we return
            raise
        for r in reqs:
            try:
                r.check_error()
            except Exception as exc:  # noqa: BLE001 - ucxx raises its own hierarchy
                raise ConnectionResetError(f"UCX transfer failed: {exc}") from None

    def cancel(self) -> None:
        """Cancel every request in flight (nothing lands in or leaves a buffer afterwards)."""
        self._cancel()

    def _cancel(self) -> None:
        try:
            if self._w is not None:
                self._w.cancel_inflight_requests()
        except Exception:
            log.debug("cancelling UCX requests failed", exc_info=True)



def _bytes_view(buf: Any) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


