"""Running a batch: one request per owner (gcache.client.planner), all owners at once.

All requests are sent before any reply is read, so the owners work in parallel and the batch
costs one round trip. Pollable streams (TCP, Unix) are driven by one poll loop: each frame is
first sent without blocking (most leave whole at once), the rest interleave as their sockets take
them, so a stalled owner holds up no other; then each reply is read as soon as its owner starts
answering. Streams that are not pollable (UCX, memory) post their request at once and
are read in the order their replies arrive. An owner without an idle connection is connected in
a thread of its own, so one that does not answer costs only its own keys the connect timeout.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gcache.client.config import LocalPath
from gcache.client.localpath import Pending, copy_all
from gcache.client.ops import Operation
from gcache.client.planner import Request, misses, plan, to_fall_back, to_retry
from gcache.client.pool import Pool
from gcache.client.routing import RoutingView
from gcache.errors import CallTimeout, ConnectionFailed, GCacheError, ServerError
from gcache.meta.ring import HashRing
from gcache.net.stream import MAX_POLL_S
from gcache.protocol import MAX_KEY_BYTES, Op, Status
from gcache.transport import Connection

Job = tuple[list[int], Connection]
# Requests that carry keys and statuses only (EXISTS, DELETE) go one per owner up to this many
# keys: the daemon answers them under one lock, and a second request only costs syscalls on
# both sides (exists of 128 keys on one daemon: 294k keys/s split at 64, 366k unsplit).
PROBE_SPLIT_KEYS = 4096
MAX_CONNECTS_PER_OWNER = 4  # new connections to one owner in one round, at most (connect_queues)
LOCAL_WAIT_S = 0.01  # local-path copies in hand wait this long for the other owners' replies at most
FINISH_GRACE_S = 0.2  # a local-path request answered in time is released or committed within this


def connect_queues(late: list[Request], most: int) -> list[list[Request]]:
    """Requests to owners without an idle connection, as queues of requests run one after
    another on one new connection: at most ``most`` queues per owner. (One thread and one new
    connection per request: a local-path batch of 100,000 small keys, split 64 keys a request,
    opened ~1,500 connections and threads at once, and connects timed out.)"""
    by_node: dict[str, list[Request]] = {}
    for req in late:
        by_node.setdefault(req.node, []).append(req)
    return [reqs[i::most] for reqs in by_node.values() for i in range(min(most, len(reqs)))]


class Fanout:
    """Runs batches for one client: its pool, its deadline per batch, its membership view
    (``view()``) and how to refresh it (``refresh()``: True if it changed; ``may_refresh()``: rate
    limit for refreshes that replies suggest)."""

    def __init__(self, pool: Pool, timeout_s: float, split_bytes: int, split_keys: int,
                 view: Callable[[], RoutingView], refresh: Callable[[float], bool], may_refresh: Callable[[], bool],
                 local_min_bytes: int = 0) -> None:
        self.pool = pool
        self.local_min_bytes = local_min_bytes
        self.timeout_s = timeout_s
        self.split_bytes, self.split_keys = split_bytes, split_keys
        self.view, self.refresh, self.may_refresh = view, refresh, may_refresh

    def run(self, op: Operation, kbytes: list[bytes], deadline: float | None = None,
            timeout_s: float | None = None) -> list[GCacheError]:
        """Run ``op`` over ``kbytes`` by ``timeout_s`` (default: the client's) from now, or by
        ``deadline`` (time.monotonic()) when that is sooner; returns the owners' failures (their
        keys are UNAVAILABLE).
        Keys a node refuses as NOT_OWNER (our membership was stale) are retried once on the
        refreshed membership; for ``op.fallback``, misses during a handover are looked up on the
        key's previous owner."""
        failures: list[GCacheError] = []
        final: set[int] = set()  # misses the owner says are final: no fallback (gcache.server.touchlog)
        view = self.view()
        own = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        deadline = own if deadline is None else min(deadline, own)
        which: Sequence[int] = range(len(kbytes))
        if kbytes and max(map(len, kbytes)) > MAX_KEY_BYTES:  # refused here, not sent: one could
            which = []  # fail its whole request
            for i, k in enumerate(kbytes):
                if len(k) > MAX_KEY_BYTES:
                    op.status[i] = Status.BAD_KEY
                else:
                    which.append(i)
        if not len(view.ring):  # nothing owns keys (every daemon declared down): unavailable
            if self.may_refresh() and self.refresh(deadline):
                view = self.view()
            if not len(view.ring):
                for i in which:
                    op.status[i] = Status.UNAVAILABLE
                failures.append(ConnectionFailed("cluster", f"no node owns keys in membership epoch {view.epoch} "
                                                            "(every daemon is down or drained)"))
                return failures
        seen = self._round(op, kbytes, which, view.ring, view.addr, view.epoch, False, failures, deadline, final)
        # refreshes are bounded by the batch's deadline: a client cut off from the masters must
        # not block a call for a master timeout per master
        if seen > view.epoch and self.may_refresh():
            self.refresh(deadline)
        retry = to_retry(op.status)
        if retry and (self.view().epoch > view.epoch or self.refresh(deadline)):
            view = self.view()
            self._round(op, kbytes, retry, view.ring, view.addr, view.epoch, False, failures, deadline, final)
        if op.fallback and view.prev_ring is not None and view.prev_addr:
            missed = misses(op.status, final)
            if missed:
                now = view.ring.owners(op.ns, [kbytes[i] for i in missed])
                before = view.prev_ring.owners(op.ns, [kbytes[i] for i in missed])
                moved = to_fall_back(missed, now, before, view.prev_addr)
                self._round(op, kbytes, moved, view.prev_ring, view.prev_addr, view.epoch, True, failures, deadline)
        return failures

    def _round(self, op: Operation, kbytes: list[bytes], which: Sequence[int], ring: HashRing, addr: dict[str, str],
               epoch: int, fallback: bool, failures: list[GCacheError], deadline: float,
               final: set[int] | None = None) -> int:
        """One parallel round over the owners (by ``ring``) of keys ``which``; returns the newest
        epoch a reply carried. Owners reached over the local path get LGET/LALLOC instead;
        ``op.finish_local`` says what to copy through the mapped arena, and the copies of the
        replies in hand run together (``_finish_local``) once every owner has answered, or as
        soon as the wait for the others passes LOCAL_WAIT_S (their leases keep running), and
        before waiting for owners still connecting."""
        if not which:
            return 0
        is_local = None
        if op.sizes is not None and op.local_op is not None and self.pool.local is not LocalPath.OFF:
            is_local = lambda node: node in addr and self.pool.is_local(node, addr[node])
        requests = plan(which, ring.owners(op.ns, [kbytes[i] for i in which]), op.sizes, self.split_bytes,
                        self.split_keys if op.moves_values else max(self.split_keys, PROBE_SPLIT_KEYS), is_local)
        local: list[tuple[list[int], Connection, Pending]] = []  # local-path replies: copies to do
        epochs = [0]
        sync_jobs: dict[int, Job] = {}  # not pollable (UCX, memory): posted now, read below
        sending: dict[int, Job] = {}  # frames the socket did not take at once
        sent: dict[int, Job] = {}  # whole frames out: replies to read

        def leased(idxs: list[int], conn: Connection) -> bool:
            """Whether this request copies through the mapped arena (the local path's lease
            protocol) rather than carrying its values over the stream."""
            if conn.arena is None or op.local_op is None:
                return False
            sizes = op.sizes
            return sizes is None or sum([sizes[i] for i in idxs]) >= self.local_min_bytes * op.lease_round_trips

        def request(idxs: list[int], conn: Connection) -> tuple[Op, dict[str, Any], list[memoryview]]:
            meta, payload = op.request(idxs, [kbytes[i] for i in idxs])
            if epoch:
                meta["ep"] = epoch
            if fallback:
                meta["fb"] = 1
            if leased(idxs, conn):  # slots, not payload
                return op.local_op, meta, []  # type: ignore[return-value]
            return op.op, meta, payload

        def receive(idxs: list[int], conn: Connection, defer: bool = True) -> bool:
            meta, plen = conn.recv_reply(deadline)
            ep = meta.get("ep")
            if isinstance(ep, int):
                epochs.append(ep)
            tomb = meta.get("tomb")
            if final is not None and isinstance(tomb, list):
                final.update(idxs[j] for j in tomb if isinstance(j, int) and 0 <= j < len(idxs))
            if leased(idxs, conn):  # copied through the mapped arena with the others in hand
                done = (idxs, conn, op.finish_local(idxs, meta, conn, self.pool, deadline))
                if defer:
                    local.append(done)
                else:
                    self._finish_local(op, [done], deadline, failures)
                return True
            op.finish(idxs, meta, plen, conn, deadline)
            self.pool.put(conn)
            return True

        def connect_and_call(req: Request) -> GCacheError | None:
            conn = None
            try:
                conn = self.pool.get(req.node, addr[req.node], deadline)
                req_op, meta, payload = request(req.idxs, conn)
                conn.send(req_op, meta, payload, deadline, self.timeout_s)
                receive(req.idxs, conn, defer=False)  # in its own thread: finished there
            except GCacheError as exc:
                self._failed(op, req.idxs, conn, exc, failures)
                return exc
            return None

        def in_turn(queue: list[Request]) -> None:
            """Requests to one owner one after another (each returns its connection to the pool,
            where the next takes it); once the owner fails (not a refusal), the rest fail alike
            without costing a connect timeout each."""
            for k, req in enumerate(queue):
                exc = connect_and_call(req)
                if exc is not None and not isinstance(exc, ServerError):
                    for rest in queue[k + 1:]:
                        self._failed(op, rest.idxs, None, exc, failures)
                    return

        late: list[Request] = []  # owners without an idle connection
        for req in requests:
            conn = None
            try:
                if req.node not in addr:
                    raise ConnectionFailed(req.node, "no address in the current membership")
                conn = self.pool.idle(req.node, addr[req.node])
                if conn is None:
                    late.append(req)
                    continue
                req_op, meta, payload = request(req.idxs, conn)
                conn.prepare(req_op, meta, payload, self.timeout_s)
                if conn.stream.pollable:  # a non-blocking send: most frames leave whole at once
                    (sent if conn.send_some(deadline) else sending)[conn.stream.fileno()] = (req.idxs, conn)
                else:
                    conn.send_some(deadline)  # posts the whole frame; completed when the reply is read
                    sync_jobs[conn.stream.fileno()] = (req.idxs, conn)
            except GCacheError as exc:
                self._failed(op, req.idxs, conn, exc, failures)

        threads = []
        if len(late) == 1 and not sending and not sent and not sync_jobs:
            connect_and_call(late[0])
        else:
            threads = [threading.Thread(target=in_turn, args=(q,), daemon=True)
                       for q in connect_queues(late, MAX_CONNECTS_PER_OWNER)]
            for t in threads:
                t.start()
        sent.update(self._poll_loop(op, sending, select.POLLOUT, deadline, failures,
                                    lambda idxs, conn: conn.send_some(deadline)))
        self._read_sync(op, sync_jobs, deadline, failures, receive)

        def flush() -> None:
            if local:
                self._finish_local(op, local, deadline, failures)
                local.clear()

        self._poll_loop(op, sent, select.POLLIN, deadline, failures, receive, flush)
        flush()
        for t in threads:
            t.join()
        return max(epochs)

    def _finish_local(self, op: Operation, local: list[tuple[list[int], Connection, Pending]], deadline: float,
                      failures: list[GCacheError]) -> None:
        """The batch's local-path copies, all at once (the daemons have answered, so the copy
        threads have the cores to themselves), then each request's release or commit. These
        owners answered in time; when another one ran the batch out of its deadline, theirs are
        still finished, within FINISH_GRACE_S."""
        copy_all([pair for _i, _c, p in local for pair in p.pairs])
        for idxs, conn, pending in local:
            try:  # each its own grace: one owner stalling here must not run out the others'
                pending.finish(max(deadline, time.monotonic() + FINISH_GRACE_S))
                self.pool.put(conn)
            except GCacheError as exc:
                self._failed(op, idxs, conn, exc, failures)

    def _read_sync(self, op: Operation, jobs: dict[int, Job], deadline: float, failures: list[GCacheError],
                   receive: Callable[[list[int], Connection], bool]) -> None:
        """Read the replies of streams that are not pollable, each as it arrives."""
        while jobs:
            streams = [conn.stream for _idxs, conn in jobs.values()]
            ready = type(streams[0]).wait_readable(streams, deadline)  # type: ignore[attr-defined]
            for stream in ready:
                idxs, conn = jobs.pop(stream.fileno())
                try:
                    receive(idxs, conn)
                except GCacheError as exc:
                    self._failed(op, idxs, conn, exc, failures)
            if not ready:
                for idxs, conn in jobs.values():
                    self._failed(op, idxs, conn, CallTimeout(conn.node, self.timeout_s), failures)
                return

    def _poll_loop(self, op: Operation, conns: dict[int, Job], event: int, deadline: float,
                   failures: list[GCacheError], step: Callable[[list[int], Connection], bool],
                   idle: Callable[[], None] | None = None) -> dict[int, Job]:
        """Run ``step`` on each connection whenever it is ready for ``event`` until it returns
        True; returns the finished ones. Connections still unfinished at the deadline fail.
        ``idle`` runs whenever LOCAL_WAIT_S pass with no connection ready."""
        done: dict[int, Job] = {}
        poller = select.poll()
        for fd in conns:
            poller.register(fd, event)
        pending = dict(conns)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = poller.poll(1000 * min(remaining, MAX_POLL_S if idle is None else LOCAL_WAIT_S))
            if not ready and idle is not None:
                idle()
            for fd, _ev in ready:
                idxs, conn = pending[fd]
                try:
                    finished = step(idxs, conn)
                except GCacheError as exc:
                    self._failed(op, idxs, conn, exc, failures)
                    del pending[fd]
                    poller.unregister(fd)
                    continue
                if finished:
                    done[fd] = pending.pop(fd)
                    poller.unregister(fd)
        for idxs, conn in pending.values():
            self._failed(op, idxs, conn, CallTimeout(conn.node, self.timeout_s), failures)
        return done

    def _failed(self, op: Operation, idxs: list[int], conn: Connection | None, exc: GCacheError,
                failures: list[GCacheError]) -> None:
        for i in idxs:
            op.status[i] = Status.UNAVAILABLE
        failures.append(exc)
        if conn is not None:
            if isinstance(exc, ServerError) and not conn.broken:
                self.pool.put(conn)  # a refusal leaves the connection in sync
            else:
                conn.close()
