"""One data-plane connection: read frames, run them against the store, answer in order.

Requests on a connection are handled one after another, so a client may pipeline them. A
request the daemon refuses (bad metadata, unknown opcode) is answered with an ERROR reply and
its payload is drained, keeping the connection usable. A frame that cannot be trusted (bad
magic, wrong version, oversized lengths) is answered and the connection is closed. Either way
only this connection is affected.

A request holds what it is served with until its payload is in and its reply is out: a PUT its
arena reservations, a GET the pins of its hits, both a connection slot that admission does not
shed. So on a socket neither may stop moving: when no byte of a request's payload arrives, or
no byte of its reply can be sent, for ``progress_timeout_s``, the connection is reset and all
of it is given back; a value not wholly received is never committed. SO_RCVTIMEO (set while a
payload is read) fails a receive that got no byte for that long; SO_SNDTIMEO (always set) is
the kernel's budget for one send call, which returns what it moved when the budget runs out,
so the send after the last byte moved fails one to two timeouts later. Either bounds one
blocked call, not the transfer: a slow but live peer moves a value of any size.
``requests_stalled`` in the daemon's stats counts such connections. Other streams (UCX's) take
the same bound as a timeout on each of their calls while a request is served.

That alone lets a payload trickle in (a byte a second) and hold its reservation for ever, so a
payload must also keep an average pace: once the daemon has spent ``frame_timeout_s`` waiting in
receives of it, the bytes received must be at least ``payload_floor_rate`` (1 MiB/s) times the
waiting past that; a value of S bytes thus takes at most frame_timeout + S / 1 MiB/s of waiting
for its sender (the daemon's own pauses, waiting for room or for the disk, do not count). A
receive that finds the payload behind (checked before each receive, so within one progress
timeout) resets the connection and releases what it held, as a stall does
(``requests_too_slow``).
"""

from __future__ import annotations

import functools
import hmac
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gcache import protocol as P
from gcache.net.readahead import ReadAheadStream
from gcache.net.stream import SocketStream, Stream
from gcache.net.wire import drain, recv_scatter, send_all
from gcache.protocol import ErrorCode, Op, Status
from gcache.ratelog import RateLimitedLog
from gcache.server.admission import AdmissionConfig, ConnState, MetaBudget
from gcache.server.framing import FrameReader, FrameTimeout, Refused
from gcache.tier.pools import parse_pool_meta
from gcache.tier.store import Hit, Reservation, Store
from gcache.tier.valuemeta import ValueMeta, parse_value_meta

if TYPE_CHECKING:
    from gcache.server.agent import Agent
    from gcache.server.metrics import RequestMetrics

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
SCRATCH_BYTES = 256 << 10  # drains refused payload; allocated on a connection's first refusal
LOCAL_OPS = (Op.LMAP, Op.LGET, Op.LDONE, Op.LALLOC, Op.LCOMMIT)
DATA_OPS = (Op.PUT, Op.GET, Op.EXISTS, Op.DELETE, Op.LGET, Op.LALLOC)
OK, NOT_FOUND, NOT_OWNER, ERROR = int(Status.OK), int(Status.NOT_FOUND), int(Status.NOT_OWNER), int(Status.ERROR)
_MAX_KEY = P.MAX_KEY_BYTES
_OPS = {int(o): o for o in Op}  # a dict lookup per request, not an Enum call
JOIN_WAIT_S = 1.0  # a request that arrives while the daemon (re)registers waits this long for it
PUT_CHUNK_BYTES = 1 << 20  # a PUT's values are reserved and received in chunks of about this much
NO_TIMEOUT = struct.pack("ll", 0, 0)  # SO_RCVTIMEO / SO_SNDTIMEO off


def timeval(seconds: float) -> bytes:
    """``seconds`` as the struct timeval of SO_RCVTIMEO / SO_SNDTIMEO (at least 1 us: 0 means none)."""
    usec = max(1, round(seconds * 1e6))
    return struct.pack("ll", usec // 1_000_000, usec % 1_000_000)


def _refuse(_key: tuple[str, bytes]) -> bool:
    return False


class PayloadTooSlow(OSError):
    """A request's payload fell behind the floor rate (AdmissionConfig.payload_floor_rate)."""


class PacedStream:
    """The stream a request's payload is read from: each receive first checks that the bytes
    received so far keep the floor rate over the time spent waiting in its receives, once that
    passed the grace (PayloadTooSlow otherwise). Everything else is the wrapped stream's own."""

    def __init__(self, stream: Any, grace_s: float, rate: int, total: int) -> None:
        self._s = stream
        self._grace, self._rate, self._total = grace_s, rate, total
        self.got = 0
        self.waited = 0.0  # seconds spent in receives of this payload
        if getattr(stream, "recvmsg_into", None) is not None:  # recv_scatter looks for it
            self.recvmsg_into = self._recvmsg_into

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    def _check(self) -> float:
        late = self.waited - self._grace
        if late > 0 and self.got < late * self._rate:
            raise PayloadTooSlow(f"{self.got} of {self._total} payload bytes in {self.waited:.1f}s of waiting")
        return time.monotonic()

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int:
        t = self._check()
        try:
            n = self._s.recv_into(buffer, nbytes, flags)
        finally:
            self.waited += time.monotonic() - t
        self.got += n
        return n

    def _recvmsg_into(self, buffers: Any, /) -> Any:
        t = self._check()
        try:
            out = self._s.recvmsg_into(buffers)
        finally:
            self.waited += time.monotonic() - t
        self.got += out[0]
        return out


class WriteGuard:
    """A store guard (gcache.tier.store.Guard) for one write request, checked as each of its
    batches lands (under the store lock). It refuses

    - the whole write, if the client has closed or reset the connection meanwhile: it gave up
      on this write (timed out) and may have written the key again elsewhere or on another
      connection since, so landing now could put an older value over an acknowledged newer one
      (a request read just before the daemon stalled, or while it waited in writable()).
      ``abandoned`` says so; such keys are answered ERROR (the client is gone, or half-closed
      against the protocol);
    - per key, if this node has since built a newer ring than both the client's epoch and the
      ring of that check, for keys it no longer owns (answered NOT_OWNER): a write admitted
      just before the ring changed could otherwise land after this node's handover read the
      key's old value and pushed it to the new owner, which would then serve that old value."""

    __slots__ = ("abandoned", "agent", "hung_up", "routed", "store")

    def __init__(self, store: Store, hung_up: Callable[[], bool], agent: Agent | None,
                 routed: tuple[int, int] | None) -> None:
        self.store, self.hung_up, self.agent, self.routed = store, hung_up, agent, routed
        self.abandoned = False

    def __call__(self) -> Callable[[tuple[str, bytes]], bool] | None:
        if self.abandoned or self.hung_up():
            if not self.abandoned:
                self.abandoned = True
                self.store.counters["writes_abandoned"] += 1  # under the store lock
            return _refuse
        agent, routed = self.agent, self.routed
        if routed is None or agent is None:
            return None
        client_epoch, checked = routed
        ring_epoch, ring = agent.routing
        if ring_epoch == checked or client_epoch >= ring_epoch:
            return None
        return lambda key: agent.owns_by(ring, key[0], key[1])

    @property
    def refused(self) -> int:
        """The status of a key this guard refused."""
        return ERROR if self.abandoned else NOT_OWNER


def value_meta_list(got: list[Hit | None]) -> list:
    """The "vm" field of a GET / LGET reply: each hit's metadata record (None for a miss)."""
    return [h.meta.to_wire() if h is not None else None for h in got]


__all__ = ["Handler", "OpFn", "Refused", "ServerContext", "parse_pool_meta"]

# A request handler for one opcode: (the connection's Handler, request id, metadata). It answers
# with handler.reply() (or not at all, for FLAG_NOREPLY requests) and refuses by raising Refused.
OpFn = Callable[["Handler", int, dict[str, Any]], None]


@dataclass
class ServerContext:
    """What every connection handler of one daemon shares. ``agent`` (membership, fencing,
    handover) is set by the daemon when it has masters; ``ops`` are extra opcodes every TCP
    connection serves (UCX_CONNECT with --ucx, gcache.server.ucx_op); ``metrics`` the per-request
    metrics when --metrics-port is given."""

    store: Store
    node_id: str
    max_payload: int
    token: str | None = None
    config: AdmissionConfig = field(default_factory=AdmissionConfig)
    budget: MetaBudget | None = None
    agent: Agent | None = None
    metrics: RequestMetrics | None = None
    ops: dict[Op, OpFn] = field(default_factory=dict)
    stalled: int = 0  # connections closed because a request's payload or reply stopped moving
    too_slow: int = 0  # connections closed because a request's payload fell behind the floor rate
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = MetaBudget(self.config.meta_budget)

    def count_stall(self) -> None:
        with self._lock:
            self.stalled += 1

    def count_too_slow(self) -> None:
        with self._lock:
            self.too_slow += 1

    def counters(self) -> dict[str, int]:
        """The connection handlers' counters, for the daemon's stats and metrics."""
        assert self.budget is not None
        return {"requests_stalled": self.stalled, "requests_too_slow": self.too_slow,
                "meta_budget_held": self.budget.used}


class Handler:
    """Serves one connection (a Stream) of the daemon: frames in, replies out, in order."""

    def __init__(self, stream: Stream, ctx: ServerContext, state: ConnState | None = None,
                 authed: bool = False) -> None:
        self._sock: socket.socket | None = None  # the socket under a SocketStream (progress bounds)
        self._ahead: ReadAheadStream | None = None
        if isinstance(stream, SocketStream):  # a frame's header and metadata in one receive
            self._sock = stream.sock
            stream = self._ahead = ReadAheadStream(stream)
            self._progress = timeval(ctx.config.progress_timeout_s)
            # a reply that cannot move for this long fails its send (the socket is blocking once
            # authenticated; before that its timeout bounds every wait)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._progress)
        self.stream = stream
        self.payload: Any = stream  # what the request's payload is read from (PacedStream when it may trickle)
        self.ctx = ctx
        self.store = ctx.store
        self.node_id = ctx.node_id
        self.agent = ctx.agent
        self.metrics = ctx.metrics
        assert ctx.budget is not None
        self.frames = FrameReader(stream, ctx.config, ctx.budget)
        self.state = state  # what admission sees of this connection (None: not admitted, e.g. UCX's inner one)
        self.authed = False
        if authed or ctx.token is None:
            self.mark_authed()
        else:  # an unauthenticated connection may only idle this long
            stream.settimeout(ctx.config.handshake_timeout_s)
        self._scratch_buf: memoryview | None = None
        self._owner_check: Callable[[str, bytes], bool] | None = None
        self.routed: tuple[int, int] | None = None  # the request's (client epoch, ring epoch it was checked by)
        self.req_flags = 0  # flags of the request being served
        self.moved = (0, 0)  # bytes in / out of an extra op's request (the local path's, for metrics)
        self.path = "tcp"  # the metrics' path label: LocalHandler "local", UCX's inner handler "ucx"
        self._ops: dict[Op, Callable[[int, dict[str, Any]], None]] = {}
        for op, fn in ctx.ops.items():
            self.register_op(op, functools.partial(fn, self))

    def register_op(self, op: Op, fn: Callable[[int, dict[str, Any]], None]) -> None:
        """Serve ``op`` with ``fn(req_id, meta)`` on this connection (a request without payload)."""
        self._ops[op] = fn

    @property
    def _scratch(self) -> memoryview:
        if self._scratch_buf is None:
            self._scratch_buf = memoryview(bytearray(SCRATCH_BYTES))
        return self._scratch_buf

    def serve(self) -> None:
        """Serve until the peer closes, stalls mid-frame, or sends a frame that cannot be trusted."""
        state = self.state
        try:
            while self.frames.next_header():
                if state is None:
                    if not self._one_request():
                        return
                    continue
                state.active = True
                try:
                    if not self._one_request():
                        return
                finally:
                    state.active = False
                    state.served = True
                    state.last = time.monotonic()
        finally:
            self.frames.close()
            self._scratch_buf = None

    def _one_request(self) -> bool:
        req_id = 0
        payload_len = 0
        consumed = 0
        armed: socket.socket | None = None  # receives time out after progress_timeout_s without a byte
        timed = self._sock is None and self.authed  # another stream: each call of this request is bounded
        if timed:
            self.stream.settimeout(self.ctx.config.progress_timeout_s)
        t0 = time.perf_counter()
        try:
            try:
                version, op, self.req_flags, req_id, meta_len, payload_len = P.unpack_header(self.frames.hdr)
            except ValueError as exc:
                raise Refused(ErrorCode.BAD_FRAME, str(exc), fatal=True) from None
            if version != P.VERSION:
                raise Refused(ErrorCode.BAD_VERSION, f"protocol version {version} not supported (speak {P.VERSION})", True)
            if payload_len > self.ctx.max_payload:
                raise Refused(ErrorCode.TOO_LARGE, f"payload of {payload_len} bytes exceeds {self.ctx.max_payload}", True)
            if not self.authed and payload_len:
                if op == Op.HELLO:
                    raise Refused(ErrorCode.BAD_META, f"HELLO carries no payload, got {payload_len} bytes", True)
                raise Refused(ErrorCode.AUTH, "authentication required: send HELLO with the cluster token first", True)
            if payload_len and self._sock is not None:
                assert self._ahead is not None
                if meta_len + payload_len > self._ahead.buffered:  # not all in yet: it may stall
                    armed = self._sock
                    armed.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._progress)
            self.payload = self.stream
            if payload_len and (armed is not None or timed):
                cfg = self.ctx.config
                self.payload = PacedStream(self.stream, cfg.frame_timeout_s, cfg.payload_floor_rate, payload_len)
            meta = self.frames.read_meta(op, meta_len, self.authed)
            known = _OPS.get(op)
            if known is None:
                raise Refused(ErrorCode.UNKNOWN_OP, f"unknown opcode {op}")
            op = known
            if op is Op.HELLO:
                if payload_len:  # refused before it authenticates anything; the payload is drained
                    raise Refused(ErrorCode.BAD_META, f"HELLO carries no payload, got {payload_len} bytes")
                self._hello(meta)
                self.reply(op, req_id, {"node": self.node_id, "v": P.VERSION})
                return True
            if not self.authed:
                raise Refused(ErrorCode.AUTH, "authentication required: send HELLO with the cluster token first", True)
            if self.agent is not None and op in DATA_OPS:
                if self.agent.fenced and not self.agent.wait_joined(JOIN_WAIT_S):
                    if self.agent.left:
                        raise Refused(ErrorCode.FENCED, f"node {self.node_id} has left the cluster (drained); "
                                                        "route by a newer membership")
                    raise Refused(ErrorCode.FENCED, f"node {self.node_id} is fenced (lost its membership lease); "
                                                    "re-registering, treat it as unavailable")
                self._owner_check = self._ownership_rule(meta)
            else:
                self._owner_check, self.routed = None, None
            extra = self._ops.get(op)
            if extra is not None:
                if payload_len:
                    raise Refused(ErrorCode.BAD_META, f"{op.name} carries no payload, got {payload_len} bytes")
                self.moved = (0, 0)
                extra(req_id, meta)
                if self.metrics is not None and op in (Op.LGET, Op.LALLOC):  # the local path's gets and puts
                    keys = meta.get("keys")
                    self.metrics.observe("get" if op is Op.LGET else "put", t0,
                                         len(keys) if isinstance(keys, list) else 0, *self.moved, path=self.path)
                return True
            if op in LOCAL_OPS:
                raise Refused(ErrorCode.UNKNOWN_OP, f"{op.name} is only served on the local (Unix socket) path")
            if op is Op.UCX_CONNECT:
                raise Refused(ErrorCode.UNKNOWN_OP, "UCX is not enabled on this daemon (start it with --ucx)")
            if op is Op.PUT:
                reply, consumed = self._put(meta, payload_len)
                self.reply(op, req_id, reply)
                if self.metrics is not None:
                    self.metrics.observe("put", t0, len(reply["st"]), consumed, path=self.path)
                return True
            if payload_len:
                raise Refused(ErrorCode.BAD_META, f"{op.name} carries no payload, got {payload_len} bytes")
            if op is Op.GET:
                sent = self._get(req_id, meta)
                if self.metrics is not None:
                    self.metrics.observe("get", t0, len(meta["keys"]), 0, sent, path=self.path)
                return True
            self.reply(op, req_id, self._simple(op, meta))
            if self.metrics is not None:
                keys = meta.get("keys")
                self.metrics.observe(op.name.lower(), t0, len(keys) if isinstance(keys, list) else 0)
            return True
        except Refused as r:
            limited.warning(f"refused-{int(r.code)}", "refused request %d from %s: %s", req_id, self._peer(), r.msg)
            if self.metrics is not None:
                self.metrics.observe("error", t0)
            try:
                if not r.fatal:
                    drain(self.payload, payload_len - consumed, self._scratch)
                self.reply(0, req_id, {"code": int(r.code), "msg": r.msg}, P.FLAG_ERROR)
            except OSError as exc:
                return self._lost(exc, req_id)
            return not r.fatal
        except OSError as exc:
            return self._lost(exc, req_id)
        except Exception as exc:  # noqa: BLE001  (a bug: answer, then drop this connection only)
            limited.error("internal", "internal error on request %d from %s", req_id, self._peer(), exc_info=True)
            try:
                self.reply(0, req_id, {"code": int(ErrorCode.INTERNAL), "msg": f"internal error: {exc}"}, P.FLAG_ERROR)
            except OSError as exc2:
                self._lost(exc2, req_id)
            return False
        finally:
            self.frames.done()
            self.payload = self.stream
            if timed:
                self.stream.settimeout(None)  # idle between requests for as long as it likes
            if armed is not None:
                try:
                    armed.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, NO_TIMEOUT)
                except OSError:
                    pass

    def _lost(self, exc: OSError, req_id: int) -> bool:
        """The connection failed mid-request; False (close it). A blocking receive or send of a
        socket that gave up (EAGAIN: SO_RCVTIMEO / SO_SNDTIMEO) means its peer stopped moving
        the payload or the reply, PayloadTooSlow that the payload fell behind the floor rate:
        counted, and the connection reset (nothing left to deliver)."""
        if isinstance(exc, PayloadTooSlow):
            self.ctx.count_too_slow()
            cfg = self.ctx.config
            limited.warning("too-slow", "reset the connection of %s: request %d's payload arrived below the floor "
                            "of %d bytes/s after a --frame-timeout (%gs) of grace: %s; what it held is released "
                            "(%d such so far)",
                            self._peer(), req_id, cfg.payload_floor_rate, cfg.frame_timeout_s, exc,
                            self.ctx.too_slow)
            self.stream.abort()
            return False
        if isinstance(exc, FrameTimeout):
            limited.info("torn-meta", "closed the connection of %s: request %d's metadata did not arrive within "
                         "--frame-timeout (%gs): %s", self._peer(), req_id, self.ctx.config.frame_timeout_s, exc)
            return False
        if (isinstance(exc, BlockingIOError) and self._sock is not None) or (
                isinstance(exc, TimeoutError) and self._sock is None and self.authed):
            self.ctx.count_stall()
            limited.warning("stalled", "reset the connection of %s: request %d's payload or reply moved no byte for "
                            "%gs (--progress-timeout); what it held is released (%d such so far)", self._peer(),
                            req_id, self.ctx.config.progress_timeout_s, self.ctx.stalled)
            self.stream.abort()
        return False

    # -- membership ---------------------------------------------------------------------------
    def _hello(self, meta: dict[str, Any]) -> None:
        given = meta.get("token")
        token = self.ctx.token
        if token is not None and not (isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())):
            raise Refused(ErrorCode.AUTH, f"{'missing' if given is None else 'wrong'} cluster token", fatal=True)
        self.mark_authed()

    def mark_authed(self) -> None:
        """The peer proved the token: it may idle between requests, and it is not shed first."""
        self.authed = True
        self.stream.settimeout(None)
        if self.state is not None:
            self.state.authed = True

    def _ownership_rule(self, meta: dict[str, Any]):
        """A per-key owner check when the client routed by another epoch than the ring this node
        routes by, else None; ``routed`` keeps both epochs for the check as writes land.

        A client that routed by an older epoch is sent to the key's new owner (NOT_OWNER). One
        that routed by a newer epoch (this node has not built that ring yet) misses here on a key
        this node does not own yet: it may hold a copy from before another node owned the key,
        which that node may have overwritten since (its write waits for this node to catch up
        instead, and is checked again then: _write_keys_status)."""
        agent = self.agent
        assert agent is not None
        ep = meta.get("ep")
        self.routed = None
        if not isinstance(ep, int) or meta.get("fb"):
            return None
        if ep > agent.epoch:
            agent.note_epoch(ep)
        return self._rule_for(ep)

    def _rule_for(self, ep: int):
        agent = self.agent
        assert agent is not None
        ring_epoch, ring = agent.routing
        self.routed = (ep, ring_epoch)
        return functools.partial(agent.owns_by, ring) if ep != ring_epoch else None

    def write_guard(self, routed: tuple[int, int] | None) -> WriteGuard:
        """For a write admitted by the owner check of ``routed``: a store guard (WriteGuard)."""
        return WriteGuard(self.store, self.stream.hung_up, self.agent, routed)

    def _write_keys_status(self, ns: str, keys: list[Any], pushed: bool = False,
                           sender: str | None = None) -> list[Status | None]:
        """_keys_status for a write, once this node may take it (Agent.writable; a previous
        owner's ``pushed`` copies, from node ``sender`` when named, only wait for this node to
        catch up with their epoch, and must belong to a handover still open), owner check by
        the ring this node routes by then."""
        agent = self.agent
        if agent is not None:
            ep = self.routed[0] if self.routed else None
            if not (agent.caught_up(ep) if pushed else agent.writable(ns, keys, ep)):
                raise Refused(ErrorCode.FENCED, f"node {self.node_id} has not caught up with the newest membership "
                                                "or is taking over keys from nodes that have not confirmed the "
                                                "change yet; treat it as unavailable for now")
            if pushed and (ep is None or ep < agent.fresh_since):
                # sent before this node registered, or before it caught up with changes of the
                # ring it missed: other nodes may have owned these keys meanwhile and taken writes
                raise Refused(ErrorCode.FENCED, f"handover copies from epoch {ep} predate node {self.node_id}'s "
                                                f"registration or a change of the ring it missed (epoch "
                                                f"{agent.fresh_since})")
            why = agent.push_refusal(sender) if pushed else None
            if why is not None:
                raise Refused(ErrorCode.FENCED, f"handover copies refused by node {self.node_id}: {why}")
            if self.routed is not None and self.routed[0] > self.routed[1]:  # it was ahead: check again
                self._owner_check = self._rule_for(self.routed[0])
        return self._keys_status(ns, keys)

    def _keys_status(self, ns: str, keys: list[Any]) -> list[Status | None]:
        """Per key: BAD_KEY, or NOT_OWNER (NOT_FOUND for a client ahead of this node) for a key
        this request must not touch, else None (the key check inlined in one comprehension: no
        call per key)."""
        out: list[Status | None] = [None if type(k) is bytes and 0 < len(k) <= _MAX_KEY else Status.BAD_KEY
                                    for k in keys]
        check = self._owner_check
        if check is not None:
            routed = self.routed
            other = Status.NOT_FOUND if routed is not None and routed[0] > routed[1] else Status.NOT_OWNER
            out = [r if r is not None or check(ns, k) else other for r, k in zip(out, keys)]
        return out

    # -- ops --------------------------------------------------------------------------------
    def _put(self, meta: dict[str, Any], payload_len: int) -> tuple[dict, int]:
        ns, keys = self._ns_keys(meta)
        sizes = meta.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != len(keys):
            raise Refused(ErrorCode.BAD_META, "PUT needs 'sizes': one non-negative int per key")
        if any(not isinstance(s, int) or s < 0 for s in sizes) or sum(sizes) != payload_len:
            raise Refused(ErrorCode.BAD_META, f"PUT sizes must be ints >= 0 summing to the payload ({payload_len})")
        vmeta = parse_value_meta(meta, len(keys), "PUT")  # optional ttl / pool / pos / tail / fmt fields
        if isinstance(vmeta, str):
            raise Refused(ErrorCode.BAD_META, f"PUT {vmeta}")
        pool = vmeta[0].pool if vmeta else None
        group = (ns, pool) if pool is not None else None
        log_ = self.agent.touchlog if self.agent is not None else None
        ho = meta.get("ho")
        handover = log_ is not None and bool(ho)  # a previous owner's pushed copies (ho: its id, or 1)
        status: list[int] = []
        # Reserved, not received yet: at most a small share of the arena, so a large batch still
        # makes room by evicting its own earlier (committed) values, as one key at a time would.
        chunk_limit = min(PUT_CHUNK_BYTES, self.store.arena.size // 16)
        chunk: list[tuple[int, Reservation]] = []  # reserved, not yet received and committed
        refused = self._write_keys_status(ns, keys, pushed=handover, sender=ho if isinstance(ho, str) else None)
        guard = self.write_guard(self.routed)
        start = 0
        got: list[Reservation | Status | None] = []  # the run's reservations...
        k = 0  # ...of which got[k:] are not in chunk yet
        try:
            while start < len(keys):  # a run of keys reserved at once, received, then committed
                end, run_bytes = start, 0
                while end < len(keys) and (end == start or run_bytes + sizes[end] <= chunk_limit):
                    run_bytes += sizes[end]
                    end += 1
                if log_ is not None and not handover:
                    for key, st in zip(keys[start:end], refused[start:end]):
                        if st is None:
                            log_.touch((ns, key))  # before the write lands: no pushed copy may overwrite it
                got, k = self.store.reserve_many([s if r is None else None for s, r in zip(sizes[start:end],
                                                                                           refused[start:end])], group), 0
                while k < len(got):
                    res, i = got[k], start + k
                    k += 1
                    if res is None or isinstance(res, Status):  # refused: its bytes are read and dropped
                        self._land(ns, keys, vmeta, chunk, handover, status, guard)
                        drain(self.payload, sizes[i], self._scratch)
                        status.append(int(res if res is not None else refused[i]))  # type: ignore[arg-type]
                    else:
                        chunk.append((i, res))
                        status.append(OK)
                self._land(ns, keys, vmeta, chunk, handover, status, guard)
                start = end
        except BaseException:
            self.store.abort_many([r for _i, r in chunk] + [r for r in got[k:] if isinstance(r, Reservation)])
            raise
        return {"st": status}, payload_len

    def _land(self, ns: str, keys: list[Any], vmeta: list[ValueMeta], chunk: list[tuple[int, Reservation]],
              handover: bool, status: list[int], guard: WriteGuard) -> None:
        """Receive the values of ``chunk`` into their reserved slots in one scatter read, then
        commit them in key order (a handover copy only where no client wrote or deleted the key;
        a key this node no longer owns by the time it lands: NOT_OWNER in ``status``)."""
        if not chunk:
            return
        recv_scatter(self.payload, [res.view for _i, res in chunk])
        if not handover:
            try:
                for n in self.store.commit_many([((ns, keys[i]), res, vmeta[i]) for i, res in chunk], guard):
                    status[chunk[n][0]] = guard.refused
            finally:
                chunk.clear()
            return
        log_ = self.agent.touchlog if self.agent is not None else None
        for n, (i, res) in enumerate(chunk):
            args = ((ns, keys[i]), res, vmeta[i])
            try:
                assert log_ is not None
                if not log_.admit((ns, keys[i]), self.store.exists, functools.partial(self.store.commit, *args)):
                    self.store.abort(res)  # superseded here: as good as handed over
            except BaseException:
                for _j, rest in chunk[n + 1:]:
                    self.store.abort(rest)
                chunk.clear()
                raise
        chunk.clear()

    def _acquire_keys(self, ns: str, keys: list[Any]) -> tuple[list[Hit | None], list[int], list[int]]:
        """Pin each key's value: (the Hit or None, the Status, the size) per key (one store lock
        for the RAM hits of the whole request)."""
        refused = self._keys_status(ns, keys)
        got = self.store.acquire_many([(ns, k) if r is None else None for k, r in zip(keys, refused)])
        status: list[int] = []
        sizes: list[int] = []
        for hit, r in zip(got, refused):
            if hit is None:
                status.append(int(r if r is not None else Status.NOT_FOUND))
                sizes.append(0)
            else:
                status.append(OK)
                sizes.append(len(hit.view))
        return got, status, sizes

    def _get(self, req_id: int, meta: dict[str, Any]) -> int:
        """Answer a GET; returns the payload bytes sent."""
        ns, keys = self._ns_keys(meta)
        got, status, sizes = self._acquire_keys(ns, keys)
        hits = [h for h in got if h is not None]
        reply: dict[str, Any] = {"st": status, "sz": sizes}
        self._mark_final_misses(ns, keys, status, reply)
        try:
            if meta.get("vm"):  # the client asked for the value-metadata records too
                reply["vm"] = value_meta_list(got)
            self.reply(Op.GET, req_id, reply, 0, [h.view for h in hits])
            return sum(sizes)
        finally:
            self.store.release_many(hits)

    def _simple(self, op: Op, meta: dict[str, Any]) -> dict[str, Any]:
        if op is Op.PING:
            pong: dict[str, Any] = {"node": self.node_id, "v": P.VERSION}
            if self.agent is not None:
                ep = meta.get("ep")
                if isinstance(ep, int) and ep > self.agent.epoch:  # a peer announces a newer epoch
                    self.agent.note_epoch(ep)
                pong["rt"] = self.agent.routing[0]  # the epoch whose ring it judges ownership by
                pong["cu"] = self.agent.catch_up_to  # it serves only once it routes by this one
                if meta.get("probe"):  # a peer's lease probe (gcache.server.vouch)
                    pong["lead"] = self.agent.leader_reachable()
            return pong
        if op is Op.STATS:
            stats: dict[str, Any] = dict(self.store.stats())
            stats.update(self.ctx.counters())
            if self.agent is not None:
                stats.update(self.agent.counters())
            if self.metrics is not None and self.metrics.address:
                stats["metrics_address"] = self.metrics.address  # `gcache stats` scrapes it
            return {"node": self.node_id, "stats": stats}
        if op is Op.EXISTS:
            return self._exists(meta)
        if op is Op.CLEAR:
            return self._clear(meta)
        return self._delete(meta)

    def _exists(self, meta: dict[str, Any]) -> dict[str, Any]:
        """A pure probe: one store lock for the whole request; ``tail`` re-marks restore-point
        pages of a pool."""
        ns, keys = self._ns_keys(meta)
        tails: list[int | None] | None = None
        if "tail" in meta:
            pooled = parse_pool_meta(meta, len(keys), "EXISTS")
            if isinstance(pooled, str):
                raise Refused(ErrorCode.BAD_META, f"EXISTS {pooled}")
            tails = list(pooled[2]) if pooled[2] is not None else None
        refused = self._keys_status(ns, keys)
        found = self.store.exists_many([(ns, k) if r is None else None for k, r in zip(keys, refused)], tails)
        out = [int(r) if r is not None else (OK if f else NOT_FOUND) for r, f in zip(refused, found)]
        reply: dict[str, Any] = {"st": out}
        self._mark_final_misses(ns, keys, out, reply)
        return reply

    def _delete(self, meta: dict[str, Any]) -> dict[str, Any]:
        ns, keys = self._ns_keys(meta)
        log_ = self.agent.touchlog if self.agent is not None else None
        refused = self._write_keys_status(ns, keys)
        if log_ is not None:
            for k, r in zip(keys, refused):
                if r is None:
                    log_.touch((ns, k))  # before the delete: no pushed copy may bring it back
        guard = self.write_guard(self.routed)
        found = self.store.delete_many([(ns, k) if r is None else None for k, r in zip(keys, refused)], guard)
        return {"st": [int(r) if r is not None else guard.refused if f is None else OK if f else NOT_FOUND
                       for r, f in zip(refused, found)]}

    def _clear(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Delete every key of the namespace held here, owned or not, as DELETE does each
        (Store.delete_namespace); touched first, like a DELETE's keys: no pushed copy brings one
        back, and a miss of one is final (gcache.server.touchlog). Stops, like a write, once its
        client has given up (closed or reset the connection)."""
        ns = meta.get("ns")
        err = P.namespace_error(ns)
        if err or not isinstance(ns, str):
            raise Refused(ErrorCode.BAD_META, err or "bad namespace")
        if extra := sorted(map(str, set(meta) - {"ns"})):  # a caller meaning something narrower must not lose it all
            raise Refused(ErrorCode.BAD_META, f"CLEAR takes only 'ns' (it deletes the whole namespace); "
                                              f"unknown fields {extra}: nothing deleted")
        if self.agent is not None:
            self.agent.touchlog.touch_namespace(ns)
        guard = self.write_guard(None)  # a client that gave up: the rest is dropped, as a write's
        n = self.store.delete_namespace(ns, guard)
        log.info("cleared namespace %r for %s: %d keys deleted%s", ns, self._peer(), n,
                 " (then the client gave up: stopped there)" if guard.abandoned else "")
        return {"n": n}

    def _mark_final_misses(self, ns: str, keys: list, status: list[int], reply: dict[str, Any]) -> None:
        """``reply["tomb"]``: positions of misses of keys a client wrote or deleted here lately,
        which a client must not look up on a previous owner (gcache.server.touchlog)."""
        if self.agent is None:
            return
        log_ = self.agent.touchlog
        final = [i for i, (k, st) in enumerate(zip(keys, status))
                 if st == Status.NOT_FOUND and log_.touched((ns, k))]
        if final:
            reply["tomb"] = final

    @staticmethod
    def _ns_keys(meta: dict[str, Any]) -> tuple[str, list]:
        ns, keys = meta.get("ns"), meta.get("keys")
        err = P.namespace_error(ns)
        if err:
            raise Refused(ErrorCode.BAD_META, err)
        if not isinstance(keys, list) or len(keys) > P.MAX_BATCH_KEYS:
            raise Refused(ErrorCode.BAD_META, f"'keys' must be a list of at most {P.MAX_BATCH_KEYS} byte strings")
        return ns, keys  # type: ignore[return-value]

    # -- replies ----------------------------------------------------------------------------
    def reply(self, op: int, req_id: int, meta: dict[str, Any], flags: int = 0,
              payload: Sequence[memoryview] | None = None) -> None:
        """Answer request ``req_id`` (``flags``: FLAG_ERROR for a refusal) with ``meta`` and
        ``payload``; the daemon's epoch rides along when it has masters."""
        if self.agent is not None:
            meta["ep"] = self.agent.epoch
        raw = P.encode_meta(meta)
        payload = payload or []
        total = sum(len(v) for v in payload)
        head = P.pack_header(op, P.FLAG_REPLY | flags, req_id, len(raw), total)
        send_all(self.stream, [head + raw, *payload])

    def _peer(self) -> str:
        return self.stream.peer()
