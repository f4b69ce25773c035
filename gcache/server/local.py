"""The local shared-memory path: a Unix socket beside the TCP port, for clients on this host.

A local client receives the arena's memfd once (LMAP, over SCM_RIGHTS), maps it, and then
copies values directly between the arena and its own buffers: one copy, no socket payload.

* LGET pins each hit slot and answers its arena offset under a *lease*; the client copies, then
  LDONE releases the lease and says whether it was still held. A lease that expired (a client
  that stalled) was released by the reaper, so its slots may have been reused: the client then
  reports those keys as misses. Values are therefore never returned torn.
* LALLOC reserves slots and answers their offsets under a lease; the client copies the values
  in; LCOMMIT makes them visible. A client that dies before committing has its reservations
  aborted on disconnect, so no slot leaks. One that stalls past the lease keeps them reserved
  until its connection's next request or its disconnect, never less: the client may still be
  copying into those slots, and giving them to another value would let it overwrite that value.
  Its LCOMMIT then still commits (the slots were never reused); any other request but LMAP (a
  client's first put maps the arena writable between LALLOC and copying) aborts them. A
  connection holding leases is never the one closed to admit another at the connection cap; one
  whose read leases the reaper released holds nothing any more and may be (a stopped reader
  must not keep its slot, and every newcomer out, for as long as it stays stopped).

Values that are not in the arena (an NVMe hit that could not be promoted) are sent inline.

LMAP hands out a read-only descriptor of the arena (opened O_RDONLY through /proc/self/fd), which
cannot be mapped writable; only ``{"rw": true}`` (a client's first local put) gets the writable
one. A reader's stray write through its mapping faults instead of corrupting others' values.
The memfd is mode 0600, so only the daemon's user (and root) could reopen it read-write.
This guards against accidents, not against a token holder: the cluster token is the only
security boundary, and anyone holding it may read and write every namespace anyway.
The socket lives in the abstract namespace (``\\0gcache/HOST:PORT``): nothing on disk to clean
up, and only processes on this host (in this network namespace) can reach it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from gcache import protocol as P
from gcache.argtypes import seconds_error
from gcache.errors import ConfigError
from gcache.net.address import unix_name
from gcache.net.stream import SocketStream
from gcache.net.wire import shutdown_quietly
from gcache.protocol import Op, Status
from gcache.server.admission import Admission, ConnState
from gcache.server.handler import Handler, Refused, ServerContext, value_meta_list
from gcache.tier.store import Hit, Reservation
from gcache.tier.valuemeta import NO_META, ValueMeta, parse_value_meta

log = logging.getLogger(__name__)
# The shortest lease (--lease): it must outlast an LGET's reply, the client's copy and its LDONE,
# and the reaper wakes every lease/4. Below this a scheduling delay turns every local get into a
# miss, and the reaper spins (at --lease 0.001, 4000 wake-ups a second).
MIN_LEASE_S = 0.05


class _Lease:
    __slots__ = ("deadline", "hits", "meta", "ns", "reservations", "routed")

    def __init__(self, deadline: float, hits: list[Hit] | None = None,
                 reservations: list[tuple[bytes, Reservation | None]] | None = None, ns: str = "",
                 meta: list[ValueMeta] | None = None, routed: tuple[int, int] | None = None) -> None:
        self.deadline, self.hits, self.reservations, self.ns, self.meta = deadline, hits, reservations, ns, meta
        self.routed = routed  # a put lease's owner check (Handler.routed), done again as LCOMMIT lands it


class LocalHandler(Handler):
    def __init__(self, stream: SocketStream, server: LocalServer, state: ConnState | None = None) -> None:
        super().__init__(stream, server.ctx, state)
        self.path = "local"
        self.unix = stream
        self.server = server
        self.lease_s = server.lease_s
        self._leases: dict[int, _Lease] = {}
        self._overdue: dict[int, _Lease] = {}  # put leases past their deadline: reserved until the next request
        self._next_lease = 1
        self._lease_lock = threading.Lock()
        for op, fn in ((Op.LMAP, self._lmap), (Op.LGET, self._lget), (Op.LDONE, self._ldone),
                       (Op.LALLOC, self._lalloc), (Op.LCOMMIT, self._lcommit)):
            self.register_op(op, fn)

    # -- leases -----------------------------------------------------------------------------
    def _new_lease(self, lease: _Lease) -> int:
        with self._lease_lock:
            lid = self._next_lease
            self._next_lease += 1
            self._leases[lid] = lease
            return lid

    def _take(self, lid: Any, to_commit: bool = False) -> _Lease | None:
        """The lease ``lid``, no longer held by this connection (None: unknown or expired).
        ``to_commit``: only a put lease (LALLOC); a read lease is refused and stays held (taken
        and not released, its slots would stay pinned for good)."""
        with self._lease_lock:
            if not isinstance(lid, int):
                return None
            lease = self._leases.get(lid) or self._overdue.get(lid)
            if lease is not None and to_commit and lease.reservations is None:
                raise Refused(P.ErrorCode.BAD_META, f"lease {lid} is a read lease (LGET): LCOMMIT takes a put "
                                                    "lease (LALLOC); it is still held, release it with LDONE")
            self._leases.pop(lid, None)
            self._overdue.pop(lid, None)
            return lease

    def _drop(self, lease: _Lease) -> None:
        if lease.hits:
            self.store.release_many(lease.hits)
        self.store.abort_many([res for _key, res in lease.reservations or () if res is not None])

    def expire(self, now: float) -> int:
        """Release leases past their deadline (called by the reaper); returns how many."""
        with self._lease_lock:
            dead = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
            leases = []
            for lid in dead:
                lease = self._leases.pop(lid)
                if lease.reservations:  # the client may be copying into them: kept (module docstring)
                    self._overdue[lid] = lease
                else:
                    leases.append(lease)
            if dead:  # a released read lease no longer protects a copy: the connection may be shed
                self._update_holding()
        for lease in leases:
            self._drop(lease)
        if dead:
            log.warning("%d lease(s) of %s expired; read pins released, %d put reservation(s) kept until "
                        "the client's next request", len(dead), self._peer(), len(dead) - len(leases))
        return len(dead)

    def _one_request(self) -> bool:
        """Serve one request; put leases that were overdue before it and not committed by it
        are aborted (the client has moved on: it is not copying into them any more)."""
        with self._lease_lock:
            # an LMAP does not count: a client's first put maps the arena between LALLOC and copying
            overdue = [] if self.frames.hdr[P.OP_OFFSET] == Op.LMAP else list(self._overdue)
        try:
            return super()._one_request()
        finally:
            if overdue:
                with self._lease_lock:
                    stale = [self._overdue.pop(lid) for lid in overdue if lid in self._overdue]
                for lease in stale:
                    self._drop(lease)
            with self._lease_lock:
                self._update_holding()

    def _update_holding(self) -> None:
        """Tell admission whether this connection holds leases (under ``_lease_lock``: the
        reaper and the connection's thread both call it). Overdue put reservations still count:
        the client may be copying into them, and shedding would abort them."""
        if self.state is not None:
            self.state.holding = bool(self._leases or self._overdue)

    def release_all(self) -> None:
        with self._lease_lock:
            leases = [*self._leases.values(), *self._overdue.values()]
            self._leases.clear()
            self._overdue.clear()
        for lease in leases:
            self._drop(lease)

    # -- ops --------------------------------------------------------------------------------
    def _lmap(self, req_id: int, meta: dict[str, Any]) -> None:
        """The arena's descriptor: read-only unless ``{"rw": true}`` (a client that puts)."""
        rw = bool(meta.get("rw"))
        raw = P.encode_meta({"size": self.store.arena.size, "id": self.server.arena_id, "rw": rw})
        head = P.pack_header(Op.LMAP, P.FLAG_REPLY, req_id, len(raw), 0)
        self.unix.send_fds([head + raw], [self.store.arena.fd if rw else self.server.read_only_fd])

    def _lget(self, req_id: int, meta: dict[str, Any]) -> None:
        ns, keys = self._ns_keys(meta)
        got, status, sizes = self._acquire_keys(ns, keys)
        hits = [h for h in got if h is not None and h.entry is not None]  # in the arena: leased
        inline = [h for h in got if h is not None and h.entry is None]  # a private copy: sent
        try:
            offs = [h.entry.off if h is not None and h.entry is not None else -1 for h in got]
            deadline = time.monotonic() + self.lease_s
            lid = self._new_lease(_Lease(deadline, hits=hits)) if hits else 0
            # "dl": the lease's deadline on CLOCK_MONOTONIC, which client and daemon share (same
            # kernel: the abstract socket is only reachable from this host). A copy finished before
            # it cannot have raced a reuse of its slots, so the client may release it one-way.
            reply = {"st": status, "sz": sizes, "off": offs, "ls": lid, "dl": deadline}
            if meta.get("vm"):
                reply["vm"] = value_meta_list(got)
            self._mark_final_misses(ns, keys, status, reply)
            self.reply(Op.LGET, req_id, reply, 0, [h.view for h in inline])
        finally:
            self.store.release_many(inline)  # their read budget (disk hits read outside the arena)
        self.moved = (0, sum(len(h.view) for h in got if h is not None))  # copied out or sent

    def _ldone(self, req_id: int, meta: dict[str, Any]) -> None:
        ids = meta.get("ls")
        if not isinstance(ids, list):
            raise Refused(P.ErrorCode.BAD_META, "LDONE needs 'ls': a list of lease ids")
        held = []
        for lid in ids:
            lease = self._take(lid)
            held.append(lease is not None)
            if lease is not None:
                self._drop(lease)
        if not self.req_flags & P.FLAG_NOREPLY:
            self.reply(Op.LDONE, req_id, {"ok": held})

    def _lalloc(self, req_id: int, meta: dict[str, Any]) -> None:
        ns, keys = self._ns_keys(meta)
        sizes = meta.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != len(keys) or any(
                not isinstance(s, int) or s < 0 for s in sizes):
            raise Refused(P.ErrorCode.BAD_META, "LALLOC needs 'sizes': one non-negative int per key")
        vmeta = parse_value_meta(meta, len(keys), "LALLOC")  # ttl / pool / pos / tail / fmt, as for PUT
        if isinstance(vmeta, str):
            raise Refused(P.ErrorCode.BAD_META, f"LALLOC {vmeta}")
        pool = vmeta[0].pool if vmeta else None
        group = (ns, pool) if pool is not None else None
        status: list[int] = []
        offs: list[int] = []
        reservations: list[tuple[bytes, Reservation | None]] = []
        log_ = self.agent.touchlog if self.agent is not None else None
        refused = self._write_keys_status(ns, keys)
        if log_ is not None:
            for key, r in zip(keys, refused):
                if r is None:
                    log_.touch((ns, key))  # before the write lands (gcache.server.touchlog)
        got = self.store.reserve_many([s if r is None else None for s, r in zip(sizes, refused)], group)
        for key, res, r in zip(keys, got, refused):
            if isinstance(res, Reservation):
                status.append(int(Status.OK))
                offs.append(res.off)
                reservations.append((key, res))
            else:
                status.append(int(res if res is not None else r))  # type: ignore[arg-type]
                offs.append(-1)
                reservations.append((key, None))
        lid = self._new_lease(_Lease(time.monotonic() + self.lease_s, reservations=reservations, ns=ns, meta=vmeta,
                                     routed=self.routed))
        self.reply(Op.LALLOC, req_id, {"st": status, "off": offs, "ls": lid})
        self.moved = (sum(res.size for _key, res in reservations if res is not None), 0)  # copied in

    def _lcommit(self, req_id: int, meta: dict[str, Any]) -> None:
        lease = self._take(meta.get("ls"), to_commit=True)
        if lease is None:
            raise Refused(P.ErrorCode.BAD_META, "lease unknown or expired: the values were not stored")
        reserved = lease.reservations or []
        held = [i for i, (_key, res) in enumerate(reserved) if res is not None]
        st = [int(Status.ERROR if res is None else Status.OK) for _k, res in reserved]
        guard = self.write_guard(lease.routed)
        for n in self.store.commit_many([((lease.ns, reserved[i][0]), reserved[i][1],  # type: ignore[misc]
                                          lease.meta[i] if lease.meta else NO_META) for i in held], guard):
            st[held[n]] = guard.refused
        self.reply(Op.LCOMMIT, req_id, {"st": st})


class LocalServer:
    """Accepts local clients on the abstract Unix socket; one thread per connection."""

    def __init__(self, ctx: ServerContext, tcp_address: str, admission: Admission, lease_s: float = 5.0) -> None:
        """Serves the same daemon as the TCP server whose context is ``ctx`` (and shares its
        ``admission``: one connection cap for both)."""
        import secrets

        self.ctx = ctx
        self.store = store = ctx.store
        self.admission = admission
        # memfds are created mode 0777: anyone handed the read-only descriptor could reopen it
        # read-write through /proc. 0600 leaves that to the daemon's own user (and root).
        os.fchmod(store.arena.fd, 0o600)
        # a descriptor of the same pages that cannot be mapped writable (what readers get)
        self.read_only_fd = os.open(f"/proc/self/fd/{store.arena.fd}", os.O_RDONLY | os.O_CLOEXEC)
        if err := seconds_error(lease_s, minimum=MIN_LEASE_S):
            raise ConfigError(f"--lease {err}", "lease_s")
        self.lease_s = lease_s
        self.arena_id = secrets.token_hex(8)
        self.name = unix_name(tcp_address)
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lsock.bind(self.name)
        self._lsock.listen(128)
        self._handlers: set[LocalHandler] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> LocalServer:
        threading.Thread(target=self._accept_loop, name="gcache-local-accept", daemon=True).start()
        threading.Thread(target=self._reap_loop, name="gcache-lease-reaper", daemon=True).start()
        return self

    def _accept_loop(self) -> None:
        self.admission.accept_loop(self._lsock, self._spawn, self._stop)

    def _spawn(self, sock: socket.socket, state: ConnState) -> None:
        threading.Thread(target=self._serve, args=(sock, state), name="gcache-local", daemon=True).start()

    def _serve(self, sock: socket.socket, state: ConnState) -> None:
        try:
            handler = LocalHandler(SocketStream(sock), self, state)
            with self._lock:
                self._handlers.add(handler)
            try:
                handler.serve()
            finally:
                with self._lock:
                    self._handlers.discard(handler)
                handler.release_all()  # a client that went away leaves no pin or reservation behind
        finally:
            self.admission.release(state)
            sock.close()

    def _reap_loop(self) -> None:
        while not self._stop.wait(min(0.2, self.lease_s / 4)):
            now = time.monotonic()
            with self._lock:
                handlers = list(self._handlers)
            for h in handlers:
                try:
                    h.expire(now)
                except Exception:  # the reaper must never die silently: leases would leak
                    log.exception("lease reaper failed for one connection")

    def stop(self) -> None:
        self._stop.set()
        shutdown_quietly(self._lsock)
        self._lsock.close()
        with self._lock:
            for h in self._handlers:
                shutdown_quietly(h.unix.sock)
        os.close(self.read_only_fd)



