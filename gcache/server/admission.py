"""Who gets a connection, and how much memory requests in flight may hold.

* **Connection cap.** The TCP and local listeners share one table of connections, capped at
  ``max_connections`` and below RLIMIT_NOFILE (minus ``fd_headroom`` descriptors kept for the
  NVMe segments, the masters and the rest), so descriptors do not run out under a flood.
* **Shedding.** At the cap a newcomer takes the place of the connection that matters least:
  one that has not authenticated, else one that never completed a request, else the one idle
  the longest (a pooled client just reconnects). A connection in the middle of a request is
  never shed: it is closed by its own handler instead once its payload or reply has not moved
  for ``progress_timeout_s`` (gcache.server.handler), so a flood of requests that stall cannot
  hold the slots for longer than that. When none can go, the newcomer is answered BUSY and
  closed. So an operator's ``gcache stats`` gets in while a flood holds every slot.
* **Out of descriptors anyway** (EMFILE/ENFILE: the limit dropped, or files took them): a spare
  descriptor kept for this moment is released to accept the newcomer, the cap shrinks to what
  fits for a while, and the accept loop backs off instead of spinning on accept().
* **Metadata budget.** Metadata above the per-connection buffer is allocated only against a
  global budget of bytes (``meta_budget``); a request that cannot get it in time is answered BUSY.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gcache import protocol as P
from gcache.argtypes import seconds_error
from gcache.errors import ConfigError
from gcache.net.wire import shutdown_quietly
from gcache.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
LISTENER_GONE = (errno.EBADF, errno.EINVAL, errno.ENOTSOCK)
LEARNED_CAP_S = 30.0  # how long a cap learned from EMFILE holds
MAX_TIMEOUT_S = 86400.0  # the longest a timeout may be set to (a socket timeout must fit a timeval)


@dataclass(frozen=True)
class AdmissionConfig:
    """Limits on connections and on what they may make the daemon hold."""

    max_connections: int = 4096  # TCP and local together; also kept below RLIMIT_NOFILE - fd_headroom
    fd_headroom: int = 64  # descriptors kept for everything but client connections
    meta_budget: int = 64 << 20  # metadata bytes of all requests being read or served at once
    handshake_timeout_s: float = 10.0  # an unauthenticated connection must send its HELLO within this
    frame_timeout_s: float = 10.0  # a frame's header and metadata must arrive within this once begun
    # a request's payload may go this long without a byte arriving, its reply without a byte leaving
    progress_timeout_s: float = 5.0
    # and, after frame_timeout_s, must have arrived at this many bytes a second on average
    payload_floor_rate: int = 1 << 20

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError("--max-connections must be >= 1", "max_connections")
        if self.fd_headroom < 0:
            raise ConfigError("the descriptor headroom must be >= 0")
        if self.meta_budget < P.PRE_AUTH_META_BYTES:
            raise ConfigError(f"--meta-budget must be at least {P.PRE_AUTH_META_BYTES} bytes", "meta_budget")
        if self.payload_floor_rate < 1:
            raise ConfigError("the payload floor rate must be >= 1 byte a second")
        for name, flag in (("handshake_timeout_s", "--handshake-timeout"), ("frame_timeout_s", "--frame-timeout"),
                           ("progress_timeout_s", "--progress-timeout")):
            value = getattr(self, name)
            if err := seconds_error(value):  # NaN passed a `<= 0` check, then broke every read
                raise ConfigError(f"{flag} {err}", name)
            if value > MAX_TIMEOUT_S:  # a socket timeout must fit a timeval
                raise ConfigError(f"{flag} must be at most {MAX_TIMEOUT_S:g} seconds, got {value!r}", name)


class ConnState:
    """What admission knows of one connection; its handler keeps it current (plain attribute
    writes: the accept thread reads them without a lock and tolerates a stale view)."""

    __slots__ = ("active", "authed", "holding", "last", "served", "shed", "since", "sock")

    def __init__(self, sock: socket.socket, authed: bool) -> None:
        self.sock = sock
        self.since = self.last = time.monotonic()
        self.authed = authed
        self.served = False  # completed a request
        self.active = False  # between a frame's header and its reply
        self.holding = False  # holds local-path leases: a client may be copying through them
        self.shed = False

    def __repr__(self) -> str:
        return f"ConnState(authed={self.authed}, served={self.served}, active={self.active}, shed={self.shed})"

    def shed_rank(self) -> tuple[bool, bool, float]:
        return self.authed, self.served, self.last  # the smallest goes first


class MetaBudget:
    """A global budget of metadata bytes; acquire waits (bounded) for room."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"MetaBudget(used={self.used}, limit={self.limit})"

    def acquire(self, n: int, timeout_s: float) -> bool:
        if n > self.limit:
            return False
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.used + n > self.limit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


def nofile_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def busy_frame(msg: str) -> bytes:
    raw = P.encode_meta({"code": int(P.ErrorCode.BUSY), "msg": msg})
    return P.pack_header(0, P.FLAG_REPLY | P.FLAG_ERROR, 0, len(raw), 0) + raw


class Admission:
    def __init__(self, config: AdmissionConfig, token_required: bool) -> None:
        self.config = config
        self.token_required = token_required
        self.budget = MetaBudget(config.meta_budget)
        self.cap = max(1, min(config.max_connections, nofile_limit() - config.fd_headroom))
        self._learned: tuple[int, float] | None = None  # (cap, until) after an EMFILE
        self._conns: set[ConnState] = set()
        self._shedding = 0
        self._lock = threading.Lock()
        self._spare_lock = threading.Lock()  # the TCP and the local accept threads share the spare
        self._spare: int | None = self._open_spare()
        self.shed_total = 0
        self.refused_total = 0

    def __repr__(self) -> str:
        return (f"Admission(connections={len(self._conns)}, cap={self._cap()}, shed={self.shed_total}, "
                f"refused={self.refused_total})")

    @staticmethod
    def _open_spare() -> int | None:
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def _cap(self) -> int:
        if self._learned is not None:
            if time.monotonic() < self._learned[1]:
                return min(self.cap, self._learned[0])
            self._learned = None
        return self.cap

    def __len__(self) -> int:
        return len(self._conns) - self._shedding

    # -- admit / release ----------------------------------------------------------------------
    def admit(self, sock: socket.socket) -> ConnState | None:
        """Register a new connection, shedding another at the cap; None (and the newcomer is
        answered BUSY and closed) when nothing can be shed."""
        victims = []
        with self._lock:
            cap = self._cap()
            while len(self) >= cap:
                victim = self._pick_victim()
                if victim is None:
                    break
                victim.shed = True
                self._shedding += 1
                self.shed_total += 1
                victims.append(victim)
            state: ConnState | None = None
            if len(self) < cap:
                state = ConnState(sock, not self.token_required)
                self._conns.add(state)
            else:
                self.refused_total += 1
        for victim in victims:
            shutdown_quietly(victim.sock)  # its handler sees EOF, closes, and releases it
        if victims:
            limited.warning("shed", "at the connection cap (%d): closed an idle connection to admit a new one "
                            "(%d so far; raise --max-connections or ulimit -n if these are real clients)",
                            cap, self.shed_total)
        if state is None:
            limited.warning("refuse", "at the connection cap (%d) with every connection busy: refused a new one "
                            "(%d so far)", cap, self.refused_total)
            try:
                sock.send(busy_frame(f"too many connections ({cap}); retry later"), socket.MSG_DONTWAIT)
            except OSError:
                pass
            sock.close()
        return state

    def _pick_victim(self) -> ConnState | None:
        best = None
        for state in self._conns:
            if state.shed or state.active or state.holding:
                continue
            if best is None or state.shed_rank() < best.shed_rank():
                best = state
        return best

    def release(self, state: ConnState) -> None:
        with self._lock:
            if state in self._conns:
                self._conns.discard(state)
                if state.shed:
                    self._shedding -= 1

    def shed_one(self) -> bool:
        """Close the connection that matters least now (out of descriptors); False if none."""
        with self._lock:
            victim = self._pick_victim()
            if victim is None:
                return False
            victim.shed = True
            self._shedding += 1
            self.shed_total += 1
        shutdown_quietly(victim.sock)
        return True

    def close_all(self) -> None:
        with self._lock:
            states = list(self._conns)
        for state in states:
            shutdown_quietly(state.sock)
        with self._spare_lock:
            if self._spare is not None:
                os.close(self._spare)
                self._spare = None

    # -- the accept loop ----------------------------------------------------------------------
    def accept_loop(self, lsock: socket.socket, spawn: Callable[[socket.socket, ConnState], None],
                    stopped: threading.Event) -> None:
        """Accept until ``stopped``: admit each connection and ``spawn`` its handler."""
        delay = 0.0
        while not stopped.is_set():
            try:
                sock, _ = lsock.accept()
            except OSError as exc:
                if stopped.is_set() or exc.errno in LISTENER_GONE:
                    return
                if exc.errno in OUT_OF_FDS:
                    delay = self._out_of_fds(lsock, exc, spawn, delay)
                    stopped.wait(delay)
                elif exc.errno not in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO, errno.EPERM):
                    limited.warning("accept", "accept failed: %s", exc)
                    stopped.wait(0.01)
                continue
            delay = 0.0
            self._start(sock, spawn)
            if self._spare is None:
                self._rearm_spare()

    def _rearm_spare(self) -> None:
        with self._spare_lock:
            if self._spare is None:
                self._spare = self._open_spare()

    def _start(self, sock: socket.socket, spawn: Callable[[socket.socket, ConnState], None]) -> None:
        state = self.admit(sock)
        if state is None:
            return
        try:
            spawn(sock, state)
        except (RuntimeError, OSError) as exc:  # can't start new thread, or the peer is already gone
            limited.warning("thread", "cannot serve a new connection (%s): closed it", exc)
            self.release(state)
            sock.close()

    def _out_of_fds(self, lsock: socket.socket, exc: OSError, spawn: Callable, delay: float) -> float:
        """accept() found no descriptor: learn a lower cap, use the spare descriptor to take the
        waiting connection in (shedding an idle one for it), back off. Returns the next delay."""
        with self._lock:
            learned = max(1, len(self) - 1)
            self._learned = (learned, time.monotonic() + LEARNED_CAP_S)
        limited.warning("fds", "out of file descriptors (%s) with %d connections: capping connections at %d "
                        "for %gs and shedding idle ones (raise ulimit -n, or lower --max-connections)",
                        os.strerror(exc.errno or 0), len(self), learned, LEARNED_CAP_S)
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            os.close(spare)
            try:
                sock, _ = lsock.accept()
            except OSError:
                sock = None
            if sock is not None:
                self._start(sock, spawn)  # at the learned cap: sheds idle ones, or answers BUSY
        else:
            self.shed_one()  # frees a descriptor for the next accept
        self._rearm_spare()
        return min(max(delay * 2, 0.005), 0.2)
