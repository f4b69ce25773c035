"""Reading one request frame's header and metadata under the daemon's limits.

Nothing is allocated for what a peer merely declares: metadata up to SMALL_META bytes lands in
a per-connection buffer (1 KiB, grown once to SMALL_META when needed), larger metadata is
allocated against the global MetaBudget. Up to 1/WHOLE_SHARE of the budget it is taken from the
budget whole before it is received (so such requests never hold part of it while waiting for
more); above, it is received into an anonymous mapping whose pages exist only once bytes arrive
(returned when the request ends), and drawn from the budget one META_STEP at a time as it
arrives: a request holds at most what it has sent plus one step, so connections that declare
very big metadata and stall cannot take the budget from the others. Such requests that between
them have more metadata in flight than the budget may wait on each other until the frame
timeout (then BUSY); 8 connections declaring 1/8 of the budget each and stalling hold it all
until their frame timeout. Before HELLO only a HELLO of at most PRE_AUTH_META_BYTES is read. A frame
that has begun must be complete within ``frame_timeout_s``; an idle, unauthenticated connection
is closed after ``handshake_timeout_s``. Waiting for the next frame of an authenticated
connection is unbounded (pooled clients keep idle connections).
"""

from __future__ import annotations

import logging
import mmap
import socket
import time
import traceback
from typing import Any

from gcache import protocol as P
from gcache.protocol import ErrorCode, Op
from gcache.ratelog import RateLimitedLog
from gcache.server.admission import AdmissionConfig, MetaBudget

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
SMALL_META = 16 << 10  # per-connection metadata buffer at most; larger metadata draws on the budget
META_STEP = 256 << 10  # metadata above this is received into an anonymous mapping, and budgeted step by step
MAPPED_META = META_STEP
WHOLE_SHARE = 8  # metadata up to 1/8 of the budget is budgeted whole (8 MiB of the default 64 MiB: any
# request of a gcache client, whose requests carry at most 4,096 keys)
MAX_META_ITEMS = 8 * P.MAX_BATCH_KEYS  # array items and map fields in one request, in all


class Refused(Exception):
    """Refuse the whole request with an ERROR reply; ``fatal`` also closes the connection."""

    def __init__(self, code: ErrorCode, msg: str, fatal: bool = False) -> None:
        super().__init__(msg)
        self.code, self.msg, self.fatal = code, msg, fatal


class FrameTimeout(OSError):
    """A begun frame did not arrive within the frame timeout."""


def recv_until(sock: Any, view: memoryview, deadline: float) -> None:
    """Fill ``view`` before ``deadline``; FrameTimeout or ConnectionResetError otherwise."""
    prev = sock.gettimeout()
    try:
        got = 0
        while got < len(view):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FrameTimeout(f"frame incomplete after its deadline ({got} of {len(view)} bytes)")
            sock.settimeout(remaining)
            try:
                n = sock.recv_into(view[got:])
            except TimeoutError:
                continue  # the loop raises FrameTimeout
            if n == 0:
                raise ConnectionResetError(f"peer closed the connection ({got} of {len(view)} bytes received)")
            got += n
    finally:
        sock.settimeout(prev)


class FrameReader:
    def __init__(self, stream: Any, config: AdmissionConfig, budget: MetaBudget) -> None:
        self.stream = stream
        self.config = config
        self.budget = budget
        self.hdr = memoryview(bytearray(P.HEADER_SIZE))
        self._small: memoryview | None = None
        self._held = 0  # budget bytes held by the request being served

    def __repr__(self) -> str:
        return f"FrameReader(held={self._held})"

    def next_header(self) -> bool:
        """Wait for the next frame's header; False when the peer closed, vanished mid-header,
        or (unauthenticated) stayed silent past the handshake timeout."""
        try:
            n = self.stream.recv_into(self.hdr)
        except OSError:
            return False
        if n == 0:
            return False
        if n < P.HEADER_SIZE:
            try:
                recv_until(self.stream, self.hdr[n:], time.monotonic() + self.config.frame_timeout_s)
            except OSError as exc:
                limited.info("torn-header", "closed a connection that sent %d of a frame header's %d bytes: %s",
                             n, P.HEADER_SIZE, exc)
                return False
        return True

    def read_meta(self, op: int, meta_len: int, authed: bool) -> dict[str, Any]:
        """Receive and decode a request's metadata; Refused (fatal ones close the connection)."""
        if not authed:
            if op != Op.HELLO:
                raise Refused(ErrorCode.AUTH, "authentication required: send HELLO with the cluster token first", True)
            if meta_len > P.PRE_AUTH_META_BYTES:
                raise Refused(ErrorCode.AUTH, f"HELLO metadata of {meta_len} bytes exceeds "
                                              f"{P.PRE_AUTH_META_BYTES}", True)
        if meta_len <= SMALL_META:
            if self._small is None or len(self._small) < meta_len:
                self._small = memoryview(bytearray(1024 if meta_len <= 1024 else SMALL_META))
            view = self._small[:meta_len]
            self._fill(view)
            try:
                return P.decode_request_meta(view)
            except ValueError as exc:
                raise Refused(ErrorCode.BAD_META, str(exc)) from None
        if meta_len > self.budget.limit:
            raise self._busy(meta_len)
        deadline = time.monotonic() + self.config.frame_timeout_s
        if meta_len <= MAPPED_META:
            if not self.budget.acquire(meta_len, self.config.frame_timeout_s):
                raise self._busy(meta_len)
            self._held = meta_len
            view = memoryview(bytearray(meta_len))
            self._fill(view, deadline)
            return self._decode(view)
        buf = mmap.mmap(-1, meta_len)
        view = memoryview(buf)
        try:
            got = 0
            # up to a WHOLE_SHARE of the budget a request takes its whole metadata's worth at once
            # (requests that each hold part and wait for more can wait on each other until all are
            # refused BUSY, a reviewer); above that it draws on the budget as the metadata
            # arrives, a step at a time, so a stalled one holds what it sent plus one step
            whole = meta_len <= self.budget.limit // WHOLE_SHARE
            while got < meta_len:
                step = meta_len if whole else min(META_STEP, meta_len - got)
                if not self.budget.acquire(step, deadline - time.monotonic()):
                    raise self._busy(meta_len)
                self._held += step
                self._fill(view[got:got + step], deadline)
                got += step
            return self._decode(view)
        except BaseException as exc:
            # the frames of a failed receive hold slices of the mapping; cleared, it can be
            # closed (else close() raised BufferError over the real error: a frame timeout)
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            view.release()
            try:
                buf.close()
            except BufferError:  # a slice still alive elsewhere: the mapping goes with it
                pass

    def _busy(self, meta_len: int) -> Refused:
        return Refused(ErrorCode.BUSY, f"no room for {meta_len} bytes of metadata now (the daemon's metadata "
                                       f"budget is {self.budget.limit} bytes); retry", fatal=True)

    @staticmethod
    def _decode(view: memoryview) -> dict[str, Any]:
        try:
            return P.decode_request_meta(view, MAX_META_ITEMS)
        except ValueError as exc:
            raise Refused(ErrorCode.BAD_META, str(exc)) from None

    def _fill(self, view: memoryview, deadline: float | None = None) -> None:
        n = 0
        if self.stream.gettimeout() is None:  # the common case: the metadata came with the header
            try:
                n = self.stream.recv_into(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = 0
            if n == len(view):
                return
        recv_until(self.stream, view[n:], deadline or time.monotonic() + self.config.frame_timeout_s)

    def done(self) -> None:
        """The request is over: give its metadata budget back."""
        if self._held:
            self.budget.release(self._held)
            self._held = 0

    def close(self) -> None:
        self.done()
        self._small = None
