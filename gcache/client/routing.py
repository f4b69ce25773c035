"""What a client routes by: the ring of the current membership, and during a handover the ring
of the owners before it (to fall back to on a miss). Kept fresh from the masters by a watch
stream, and on demand when a daemon's reply carries a newer epoch."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gcache.errors import ConfigError, GCacheError
from gcache.meta import delta
from gcache.meta.master_client import AuthFailed, Backoff, MasterClient, MasterUnavailable
from gcache.meta.membership import Membership
from gcache.meta.ring import HashRing

log = logging.getLogger(__name__)
# After a stream that worked breaks (its master died), wait uniform(0, this) before re-attaching:
# every client of that master is re-attaching at the same moment, and a spread-out arrival is
# served at once where a burst queues. The client keeps routing by what it holds meanwhile.
REATTACH_SPREAD_S = 1.0
# Once attached, the connection to the master tried next is opened this many seconds later
# (uniform), and kept open for the re-attach (MembershipWatcher._attempt).
STANDBY_AFTER_S = (2.0, 10.0)
# A client being made waits this long for its watch's first master, then asks every master at once.
FIRST_ANSWER_S = 0.2


@dataclass(frozen=True)
class RoutingView:
    membership: Membership
    ring: HashRing
    addr: dict[str, str]
    prev_ring: HashRing | None = None
    prev_addr: dict[str, str] | None = None

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    @classmethod
    def build(cls, membership: Membership, allow_empty: bool = False) -> RoutingView:
        """The rings of ``membership``, built with the parameters it carries (so this client
        agrees with the daemons about every key's owner). With ``allow_empty`` a membership in
        which nothing owns keys (every daemon declared down) is a view with an empty ring:
        every key unavailable, instead of routing on by an older membership."""
        ring = membership.build_ring()
        if ring is None:
            if not allow_empty:
                raise ConfigError(f"membership epoch {membership.epoch} has no node that owns keys")
            ring = HashRing({}, membership.ring)
        addr = {nid: n.address for nid, n in membership.owners().items()}
        prev_ring = membership.build_previous_ring()
        prev_addr = None
        if membership.previous:
            alive = {n.node_id: n.address for n in membership.nodes if n.state.value in ("up", "suspect", "draining")}
            prev_addr = {n.node_id: alive[n.node_id] for n in membership.previous if n.node_id in alive}
        return cls(membership, ring, addr, prev_ring, prev_addr)


class MembershipWatcher:
    """Follows one master's WatchMembership stream in a thread, calling ``on_update``.

    The stream's first message is the whole membership, so a client is usable after one round
    trip (``wait_first``). Masters are tried in a random order; after a stream breaks (its
    master died) or an attempt fails, the next master is tried after a jittered, growing pause.
    With ``standby``, the connection to the master tried next is opened in advance (see
    ``_attempt``); off by default: in the 5,000-watcher bench it doubled the connections and
    raised the masters' CPU without shortening the re-attach storm.
    An attempt that brings no membership within ``attempt_timeout_s`` (a master that accepts
    but does not answer) is abandoned for the next master."""

    def __init__(self, masters: MasterClient, on_update: Callable[[Membership], None],
                 attempt_timeout_s: float = 1.0, standby: bool = False) -> None:
        self.masters = masters
        self.standby = standby
        self.on_update = on_update
        self.attempt_timeout_s = attempt_timeout_s
        self.error: GCacheError | None = None  # why the last attempt failed (AuthFailed: a wrong token)
        self.attaches = 0  # streams that delivered a membership
        self.known = -1  # epoch of the last membership delivered
        self.address = ""  # the master of the last stream that delivered one
        self.trying = ""  # the master of the stream being attempted now
        self._held: dict[str, Any] | None = None  # that membership as the master sent it (deltas apply to it)
        self._first = threading.Event()
        self._stop = threading.Event()
        self._failed: dict[str, str] = {}  # master -> why its last attempt failed, until one delivers
        self._call: Any = None
        self._standby_timer: threading.Timer | None = None
        self._thread = threading.Thread(target=self._run, name="gcache-watch", daemon=True)

    @classmethod
    def attach(cls, masters: MasterClient, on_update: Callable[[Membership], None], where: str) -> MembershipWatcher:
        """A started watch, once ``on_update`` has had a membership to route by (raises the
        reason when none came: a refused token, no master answering). A silent first master
        costs ``FIRST_ANSWER_S``, not its whole attempt: then the other masters are asked at once and
        the first answer makes the client usable while the watch goes on to the next master."""
        watcher = cls(masters, on_update).start()
        usable = watcher.wait_first(FIRST_ANSWER_S)
        if not usable and watcher.error is None and len(masters.addresses) > 1:
            # the others: the one the watch is trying is asked already (and may be the slow one)
            m = masters.first_answer("GetMembership", {}, watcher.attempt_timeout_s,
                                     accept=lambda m: bool(Membership.from_master(m).owners()),
                                     skip=watcher.trying)
            if m is not None:
                on_update(Membership.from_master(m))
                usable = True
        if not usable and not watcher.wait_first(watcher.attempt_timeout_s * len(masters.addresses) + 1.0):
            err = watcher.error
            watcher.stop()
            if isinstance(err, GCacheError):
                raise err
            raise MasterUnavailable(f"no master at {where} answered")
        return watcher

    def start(self) -> MembershipWatcher:
        self._thread.start()
        return self

    def wait_first(self, timeout_s: float) -> bool:
        """Wait until the first membership has been taken in; False (see ``error``) when the
        deadline passed or an attempt failed on the token or on a membership it cannot use."""
        self._first.wait(timeout_s)
        return self.attaches > 0

    def _run(self) -> None:
        order = self.masters.shuffled()
        backoff = Backoff()
        i = 0
        while not self._stop.is_set():
            address = order[i % len(order)]
            i += 1
            nxt = order[i % len(order)]
            self.trying = address
            if self._attempt(address, nxt if self.standby and nxt != address else None):
                backoff.reset()
                self._failed.clear()
                wait = random.uniform(0, REATTACH_SPREAD_S)
            else:
                wait = backoff.next()
                if self.attaches == 0 and len(self._failed) == len(order) and not self._first.is_set():
                    # every master tried once and none delivered: a client being made learns
                    # why now, not after its whole bootstrap timeout
                    if self.error is None:
                        self.error = MasterUnavailable("no master answered: " + "; ".join(
                            f"{a}: {why}" for a, why in sorted(self._failed.items())))
                    self._first.set()
            if self._stop.wait(wait):
                return

    def _attempt(self, address: str, standby: str | None = None) -> bool:
        """One stream, until it breaks; True if it delivered at least one membership. Once it
        has, the connection to ``standby`` (the master tried next) is set up (a few seconds
        later: STANDBY_AFTER_S) and kept open, so
        that re-attaching there after this master fails is one new stream, not a new connection
        (about half the CPU, at both ends, of a re-attach storm)."""
        got = False
        try:
            call = self.masters.watch(address, self.known)
        except ValueError as exc:  # the channel was closed under us (stop)
            log.debug("watch on %s not started: %s", address, exc)
            return False
        self._call = call
        timer = threading.Timer(self.attempt_timeout_s, lambda: got or call.cancel())
        timer.daemon = True
        timer.start()
        try:
            for m in call:
                timer.cancel()
                if "delta" in m:
                    if self._held is None or self._held["epoch"] != m["delta"]:
                        raise GCacheError(f"a delta from epoch {m['delta']} but this client holds {self.known}")
                    m = delta.apply(self._held, m)
                if not m.get("unchanged"):
                    membership = Membership.from_master(m)
                    if not got and self.attaches == 0 and not membership.owners():
                        # nothing to route by yet (a master still catching up, or no daemon has
                        # registered): wait on this stream for the next epoch
                        self._held, self.known = m, membership.epoch
                        self.error = ConfigError(f"membership epoch {membership.epoch} from {address} has no "
                                                 "node that owns keys (no daemon registered yet?)")
                        continue
                    self.on_update(membership)
                    self._held, self.known = m, membership.epoch
                if not got:
                    got = True
                    self.attaches += 1
                    self.address = address
                    if standby is not None:
                        self._prepare_later(standby)
                self.error = None
                self._first.set()
                if self._stop.is_set():
                    break
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                self.error = AuthFailed(f"master {address} refused the cluster token: {exc.details()}")
                self._first.set()
            elif not self._stop.is_set():
                log.debug("watch on %s ended: %s", address, exc.code())
            if not got:
                self._failed[address] = (f"no membership within {self.attempt_timeout_s:g}s"
                                         if exc.code() == grpc.StatusCode.CANCELLED else
                                         f"{exc.code().name} {exc.details()}")
        except (GCacheError, ValueError, KeyError) as exc:
            log.warning("unusable membership from %s: %s", address, exc)
            self.known, self._held = -1, None  # the next attempt asks for the whole membership
            self.error = exc if isinstance(exc, GCacheError) else GCacheError(str(exc))
            self._first.set()
            call.cancel()
        finally:
            timer.cancel()
        return got

    def _prepare_later(self, standby: str) -> None:
        """Open the standby connection a few seconds from now, at a random moment: the clients
        that just re-attached together (their master failed) must not also connect together."""
        if self._standby_timer is not None:
            self._standby_timer.cancel()
        timer = self._standby_timer = threading.Timer(random.uniform(*STANDBY_AFTER_S), self.masters.prepare,
                                                      (standby,))
        timer.daemon = True
        timer.start()

    def refresh(self, deadline: float | None = None) -> Membership | None:
        """Fetch the membership now, by ``deadline`` (time.monotonic()) when given; None if no
        master answers (in time)."""
        try:
            return Membership.from_master(self.masters.membership(deadline))
        except GCacheError as exc:
            log.warning("membership refresh failed: %s", exc)
            return None

    def stop(self) -> None:
        self._stop.set()
        if self._standby_timer is not None:
            self._standby_timer.cancel()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=2)
        self.masters.close()


def rate_limited(period_s: float) -> Callable[[], bool]:
    last = [0.0]

    def ok() -> bool:
        now = time.monotonic()
        if now - last[0] < period_s:
            return False
        last[0] = now
        return True

    return ok
