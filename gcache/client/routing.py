"""What a client routes by: the ring of the current membership, and during a handover the ring
of the owners before it (to fall back to on a miss). Kept fresh from the masters by a watch
stream, and on demand when a daemon's reply carries a newer epoch."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gcache.errors import ConfigError, GCacheError
from gcache.meta.master_client import MasterClient
from gcache.meta.membership import Membership
from gcache.meta.ring import HashRing

log = logging.getLogger(__name__)


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
    def build(cls, membership: Membership) -> RoutingView:
        """The rings of ``membership``, built with the parameters it carries (so this client
        agrees with the daemons about every key's owner)."""
        ring = membership.build_ring()
        if ring is None:
            raise ConfigError(f"membership epoch {membership.epoch} has no node that owns keys")
        addr = {nid: n.address for nid, n in membership.owners().items()}
        prev_ring = membership.build_previous_ring()
        prev_addr = None
        if membership.previous:
            alive = {n.node_id: n.address for n in membership.nodes if n.state.value in ("up", "suspect", "draining")}
            prev_addr = {n.node_id: alive[n.node_id] for n in membership.previous if n.node_id in alive}
        return cls(membership, ring, addr, prev_ring, prev_addr)


class MembershipWatcher:
    """Follows the masters' WatchMembership stream in a thread, calling ``on_update``."""

    def __init__(self, masters: MasterClient, on_update: Callable[[Membership], None]) -> None:
        self.masters = masters
        self.on_update = on_update
        self._stop = threading.Event()
        self._calls: list[Any] = []
        self._thread = threading.Thread(target=self._run, name="gcache-watch", daemon=True)

    def start(self) -> MembershipWatcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            address = self.masters.addresses[i % len(self.masters.addresses)]
            try:
                call = self.masters.watch(address)
                self._calls = [call]
                for m in call:
                    self.on_update(Membership.from_master(m))
                    if self._stop.is_set():
                        return
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                log.debug("watch on %s ended: %s", address, exc.code())
            except GCacheError as exc:
                log.warning("bad membership from %s: %s", address, exc)
            i += 1
            self._stop.wait(0.2)

    def refresh(self) -> Membership | None:
        """Fetch the membership now (None if no master answers)."""
        try:
            return Membership.from_master(self.masters.membership())
        except GCacheError as exc:
            log.warning("membership refresh failed: %s", exc)
            return None

    def stop(self) -> None:
        self._stop.set()
        for call in self._calls:
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
