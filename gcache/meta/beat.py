"""Heartbeats over UDP: one authenticated datagram each way, on the master's gRPC port number.

A gRPC call costs a master about 0.4-0.6 ms of CPU; a fleet of 1,000 daemons heartbeating 3
masters every second would spend most of a core per master on call overhead, and the calls
would wait behind watch fan-outs on the event loop. A datagram costs a few tens of µs and is
answered by a thread of its own (``BeatListener``), not the loop.

Format: msgpack map + the first 16 bytes of HMAC-SHA256 over it, keyed by a hash of the cluster
token. Request ``{"v", "node", "inc", "seq", "epoch"}``; reply ``{"v", "seq", ...}`` with the
same fields as the Heartbeat RPC's reply. ``seq`` grows with every request a process sends: the
master ignores a request whose seq is not above the last one it took for that node incarnation
(a replayed heartbeat cannot keep a dead node alive), and a daemon takes only the reply to the
seq it sent (a replayed "ok" cannot unfence it). A request that fails authentication gets a short
unauthenticated ``{"v", "error": "auth"}`` so a wrong token is reported rather than silently
timing out. A sealed request with bad fields is answered ``{"v", "error": "bad request"}``
(sealed) when that is no larger than it. Replies are never larger than requests.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from gcache.meta.fields import MAX_INT, heartbeat_error, int_error
from gcache.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)  # what a peer can send at will must not flood the log

VERSION = 1
MAC_LEN = 16
MAX_DATAGRAM = 1024
AUTH_ERROR = msgpack.packb({"v": VERSION, "error": "auth"})
RESOLVE_RETRY_S = 10.0  # a master whose name did not resolve is looked up again this often
INCARNATIONS_KEPT = 4  # per node, the last seq taken of its newest incarnations


def beat_key(token: str) -> bytes:
    return hashlib.sha256(b"gcache heartbeat v1\0" + token.encode()).digest()


def seal(key: bytes, obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj)
    return body + hmac.new(key, body, hashlib.sha256).digest()[:MAC_LEN]


def unseal(key: bytes, data: bytes) -> dict[str, Any] | None:
    """The message, or None if it is not one this key sealed (or not a map)."""
    if len(data) <= MAC_LEN:
        return None
    body, mac = data[:-MAC_LEN], data[-MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()[:MAC_LEN]):
        return None
    try:
        obj = msgpack.unpackb(body, raw=False)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types; a bad body is dropped
        return None
    return obj if isinstance(obj, dict) and obj.get("v") == VERSION else None


class BeatListener:
    """The master's side: a thread answering heartbeat datagrams with ``handle(request) -> reply``
    (thread-safe; the same function as the Heartbeat RPC's)."""

    def __init__(self, host: str, port: int, token: str, handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.key, self.handle = beat_key(token), handle
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host.strip("[]"), port))
        self.sock.settimeout(0.5)
        self._last: dict[str, dict[int, int]] = {}  # node -> {incarnation: seq last taken}, the newest few
        self._stop = threading.Event()
        self.answered = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)

    def start(self) -> BeatListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                reply = self._answer(data, addr)
                if reply is not None:
                    self.sock.sendto(reply, addr)
            except Exception:  # noqa: BLE001 - one bad datagram must not stop heartbeats
                limited.log(logging.ERROR, "failed", "heartbeat from %s failed", addr, exc_info=True)

    def _answer(self, data: bytes, addr: Any = None) -> bytes | None:
        req = unseal(self.key, data)
        if req is None:
            self.refused += 1
            return AUTH_ERROR if len(data) >= len(AUTH_ERROR) else None  # never larger than the request
        err = heartbeat_error(req) or int_error(req, "seq", 0, MAX_INT)
        if err is not None:  # sealed, so sent by a holder of the token: a bug, or another version
            self.refused += 1
            limited.warning("bad", "refused a heartbeat from %s: %s", addr, err)
            reply = seal(self.key, {"v": VERSION, "error": "bad request"})
            return reply if len(reply) <= len(data) else None
        node, inc, seq = req["node"], req["inc"], req["seq"]
        taken = self._last.setdefault(node, {})
        if seq <= taken.get(inc, -1):
            return None  # a replay (or a duplicate): not evidence of life
        # per incarnation: a replayed datagram of an older one must not reset the newest one's
        # mark (before, alternating replays of two incarnations kept a dead node up)
        taken[inc] = seq
        if len(taken) > INCARNATIONS_KEPT:
            del taken[min(taken)]
        self.answered += 1
        return seal(self.key, {**self.handle(req), "v": VERSION, "seq": seq})


class BeatClient:
    """The daemon's side: one heartbeat to every master, in parallel, over one datagram socket."""

    _seq_lock = threading.Lock()
    _seq = 0

    def __init__(self, addresses: list[str], token: str) -> None:
        self.key = beat_key(token)
        self.addresses = list(addresses)
        self.targets: dict[tuple[Any, ...], str] = {}
        self._resolve_lock = threading.Lock()
        self._resolving = False
        self._resolved_at = time.monotonic()
        self._resolve(self.addresses)

    def _resolve(self, addresses: list[str]) -> None:
        """Add the UDP address of each of ``addresses``. One whose name does not resolve (a master
        pod rescheduled, its DNS record not back yet) is left out, said in a warning, and looked
        up again every RESOLVE_RETRY_S by a thread of its own (a slow DNS must not hold up a
        heartbeat round past fence-after); its heartbeats go over gRPC meanwhile
        (MasterClient.heartbeat_all). Before, one such name stopped the daemon from starting."""
        for a in addresses:
            host, _, port = a.rpartition(":")
            try:
                info = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
            except OSError as exc:
                limited.warning(f"resolve {a}", "master %s does not resolve (%s); its heartbeats go over gRPC "
                                "until it does", a, exc)
                continue
            with self._resolve_lock:
                self.targets = {**self.targets, info[4][:2]: a}  # copied: a round may be iterating it

    def _resolve_later(self) -> None:
        """Look up the masters not resolved yet, in a thread, at most every RESOLVE_RETRY_S."""
        with self._resolve_lock:
            if self._resolving or time.monotonic() - self._resolved_at <= RESOLVE_RETRY_S:
                return
            self._resolving, self._resolved_at = True, time.monotonic()
            missing = [a for a in self.addresses if a not in self.targets.values()]

        def run() -> None:
            try:
                self._resolve(missing)
            finally:
                with self._resolve_lock:
                    self._resolving = False

        threading.Thread(target=run, name="gcache-resolve-masters", daemon=True).start()

    @classmethod
    def next_seq(cls) -> int:
        with cls._seq_lock:
            cls._seq = max(cls._seq + 1, time.monotonic_ns())
            return cls._seq

    def round(self, request: dict[str, Any], timeout_s: float) -> tuple[dict[str, dict[str, Any]], bool]:
        """Send ``request`` to every master; ({master address: reply}, whether some master said
        the token is wrong) once all answered or ``timeout_s`` passed."""
        if len(self.targets) < len(self.addresses):
            self._resolve_later()
        seq = self.next_seq()
        payload = seal(self.key, {**request, "v": VERSION, "seq": seq})
        replies: dict[str, dict[str, Any]] = {}
        auth_error = False
        families = {socket.AF_INET6 if ":" in t[0] else socket.AF_INET for t in self.targets}
        socks = [socket.socket(f, socket.SOCK_DGRAM) for f in families]
        try:
            for target in self.targets:
                for s in socks:
                    if s.family == (socket.AF_INET6 if ":" in target[0] else socket.AF_INET):
                        try:
                            s.sendto(payload, target)
                        except OSError:
                            pass
            deadline = time.monotonic() + timeout_s
            while len(replies) < len(self.targets):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                ready, _, _ = select.select(socks, [], [], remaining)
                for s in ready:
                    try:
                        data, addr = s.recvfrom(MAX_DATAGRAM)
                    except OSError:  # e.g. ICMP port unreachable from a dead master
                        continue
                    master = self.targets.get(addr[:2])
                    if master is None:
                        continue
                    if data == AUTH_ERROR:
                        auth_error = True
                        continue
                    reply = unseal(self.key, data)
                    if reply is not None and reply.get("seq") == seq:
                        reply.pop("v", None)
                        reply.pop("seq", None)
                        replies[master] = reply
        finally:
            for s in socks:
                s.close()
        return replies, auth_error
