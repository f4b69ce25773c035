"""Client of the master group, used by daemons (register, heartbeat, handover) and clients
(membership). Starts at a random master (so a fleet spreads over the group) and tries the others
in turn; a wrong token fails at once with a clear error. Heartbeats go to every master as UDP
datagrams (gcache.meta.beat); a master that has not answered one within half the deadline gets
the Heartbeat RPC instead, so a network that drops UDP costs latency, not membership."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from gcache.env import SCHEME
from gcache.errors import ConfigError, GCacheError
from gcache.meta import rpc
from gcache.meta.beat import BeatClient
from gcache.net.address import address_error


class MasterUnavailable(GCacheError, ConnectionError):
    """No master answered (a network failure, not a bad setting)."""


class AuthFailed(GCacheError):
    """The master refused the cluster token."""


class Backoff:
    """Exponential backoff with full jitter: the n-th wait is uniform in [0, min(cap, base * 2**n)],
    so clients that lost the same master do not come back in lockstep."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0) -> None:
        self.base_s, self.cap_s = base_s, cap_s
        self.failures = 0

    def next(self) -> float:
        wait = random.uniform(0, min(self.cap_s, self.base_s * (2 ** self.failures)))
        self.failures = min(self.failures + 1, 30)
        return wait

    def reset(self) -> None:
        self.failures = 0


def parse_masters(spec: str | list[str]) -> list[str]:
    """``gcache://h1:p1,h2:p2`` (or a plain list) -> [HOST:PORT, ...]; ConfigError naming the
    entry that is not a HOST:PORT (gcache.net.address.address_error)."""
    given = spec
    if isinstance(spec, str):
        spec = spec.strip()
        if "://" in spec and not spec.startswith(SCHEME):
            raise ConfigError(f"master list {given!r}: expected gcache://HOST:PORT[,HOST:PORT...] "
                              f"(not {spec.split('://', 1)[0]}://)")
        spec = spec.removeprefix(SCHEME).split(",")
    out = [s.strip().rstrip("/") for s in spec if s.strip()]
    if not out:
        raise ConfigError(f"master list {given!r}: expected gcache://HOST:PORT[,HOST:PORT...]")
    for a in out:
        if err := address_error(a):
            raise ConfigError(f"master list {given!r}: {err}")
    return out


class MasterClient:
    def __init__(self, masters: str | list[str], token: str | None, timeout_s: float = 1.0,
                 channel_options: list[tuple[str, Any]] = rpc.CHANNEL_OPTIONS) -> None:
        """``channel_options``: rpc.CHANNEL_OPTIONS (daemons, tools) or rpc.CLIENT_CHANNEL_OPTIONS
        (a client's membership watch: see there)."""
        self.addresses = parse_masters(masters)
        self.token = token
        self.timeout_s = timeout_s
        self._channels = {a: grpc.insecure_channel(a, options=channel_options) for a in self.addresses}
        self._preferred = random.randrange(len(self.addresses))
        self._lock = threading.Lock()
        self._beats = BeatClient(self.addresses, token) if token else None
        self._ready: dict[str, Any] = {}  # address -> grpc.channel_ready_future (prepare)

    def _md(self) -> tuple[tuple[str, str], ...]:
        return ((rpc.TOKEN_HEADER, self.token),) if self.token else ()

    def _method(self, address: str, name: str, streaming: bool = False) -> Any:
        ch = self._channels[address]
        path = f"/{rpc.SERVICE}/{name}"
        make = ch.unary_stream if streaming else ch.unary_unary
        return make(path, request_serializer=rpc.pack, response_deserializer=rpc.unpack)

    def call(self, name: str, request: dict[str, Any], timeout_s: float | None = None,
             accept: Callable[[dict[str, Any]], bool] | None = None, deadline: float | None = None) -> dict[str, Any]:
        """Call one master, trying the others when it is unreachable (or, with ``accept``, when
        its answer is not acceptable); ``timeout_s`` per master, and all of it by ``deadline``
        (time.monotonic()) when given."""
        timeout = timeout_s or self.timeout_s
        errors = []
        n = len(self.addresses)
        for i in range(n):
            idx = (self._preferred + i) % n
            address = self.addresses[idx]
            if deadline is not None:  # each master left gets its share of the time left
                timeout = min(timeout, (deadline - time.monotonic()) / (n - i))
                if timeout <= 0:
                    errors.append(f"{address}: not tried (out of time)")
                    break
            try:
                out: dict[str, Any] = self._method(address, name)(request, timeout=timeout, metadata=self._md())
                if accept is not None and not accept(out):
                    errors.append(f"{address}: answer not accepted")
                    continue
                self._preferred = idx
                return out
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise AuthFailed(f"master {address} refused the cluster token: {exc.details()}") from None
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    raise GCacheError(f"master {address}: {exc.details()}") from None
                errors.append(f"{address}: {code.name} {exc.details()}")
        raise MasterUnavailable("no master answered: " + "; ".join(errors))

    def call_all(self, name: str, request: dict[str, Any], timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Call every master in parallel; the answers of those that replied."""
        timeout = timeout_s or self.timeout_s
        if name == "Heartbeat" and self._beats is not None:
            return self.heartbeat_all(request, timeout)
        return self._call_all(name, request, timeout, self.addresses)

    def heartbeat_all(self, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """One heartbeat to every master: UDP first, the RPC for masters silent after half the
        deadline. The replies of those that answered."""
        assert self._beats is not None
        replies, auth_error = self._beats.round(request, timeout_s / 2)
        missing = [a for a in self.addresses if a not in replies]
        out = list(replies.values())
        if missing:
            out += self._call_all("Heartbeat", request, timeout_s / 2, missing)
        if auth_error and not out:
            raise AuthFailed("the masters refused this cluster token (heartbeat)")
        return out

    def _call_all(self, name: str, request: dict[str, Any], timeout: float, addresses: list[str]) -> list[dict[str, Any]]:
        futs = [self._method(a, name).future(request, timeout=timeout, metadata=self._md()) for a in addresses]
        out = []
        for f in futs:
            try:
                out.append(f.result())
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise AuthFailed(f"a master refused the cluster token: {exc.details()}") from None
        return out

    def first_answer(self, name: str, request: dict[str, Any], timeout_s: float,
                     accept: Callable[[dict[str, Any]], bool] = lambda _: True,
                     skip: str | None = None) -> dict[str, Any] | None:
        """Call every master (but ``skip``) at once; the first acceptable answer, or None when
        none came within ``timeout_s`` (a silent master costs nothing when another answers)."""
        done: queue.Queue[dict[str, Any] | None] = queue.Queue()

        def finished(fut: Any) -> None:
            try:
                out = fut.result()
                done.put(out if accept(out) else None)
            except (grpc.RpcError, grpc.FutureCancelledError, KeyError, TypeError, ValueError):
                done.put(None)

        futs = [self._method(a, name).future(request, timeout=timeout_s, metadata=self._md())
                for a in self.addresses if a != skip]
        for f in futs:
            f.add_done_callback(finished)
        deadline = time.monotonic() + timeout_s
        try:
            for _ in futs:
                try:
                    out = done.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    return None
                if out is not None:
                    return out
            return None
        finally:
            for f in futs:
                f.cancel()

    def watch(self, address: str, known: int = -1) -> Any:
        """Memberships streamed by one master: an iterator of dicts that raises grpc.RpcError
        when the master goes away, and a grpc call (``cancel()``). With ``known`` (the epoch held
        already) the first message may be ``{"epoch": known, "unchanged": True}``."""
        return self._method(address, "WatchMembership", streaming=True)({"known": known}, metadata=self._md())

    def connect(self, address: str, timeout_s: float) -> None:
        """Wait until this client's connection to ``address`` is set up (grpc.FutureTimeoutError
        after ``timeout_s``)."""
        grpc.channel_ready_future(self._channels[address]).result(timeout=timeout_s)

    def prepare(self, address: str) -> None:
        """Start setting up the connection to ``address`` without a call and without waiting, so
        that a later call there (a watch re-attaching after its master failed) skips the TCP and
        HTTP/2 set-up. Kept open by keepalive pings."""
        old = self._ready.get(address)
        if old is None or old.done():
            self._ready[address] = grpc.channel_ready_future(self._channels[address])

    def prepared(self, address: str) -> bool:
        """The connection ``prepare`` started to ``address`` was set up."""
        fut = self._ready.get(address)
        return fut is not None and fut.done() and not fut.cancelled()

    def shuffled(self) -> list[str]:
        """The masters in a random order (each watcher starts somewhere else)."""
        return random.sample(self.addresses, len(self.addresses))

    def membership(self, deadline: float | None = None) -> dict[str, Any]:
        return self.call("GetMembership", {}, deadline=deadline)

    def membership_at_least(self, epoch: int, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The membership from a master that has applied ``epoch`` (a master whose Raft core
        lags, or is stopped, still answers from what it last applied); the preferred master
        first, then the others; None if none has it."""
        try:
            return self.call("GetMembership", {}, timeout_s, accept=lambda m: int(m["epoch"]) >= epoch)
        except MasterUnavailable:
            return None

    def close(self) -> None:
        for fut in self._ready.values():
            fut.cancel()
        for ch in self._channels.values():
            ch.close()
