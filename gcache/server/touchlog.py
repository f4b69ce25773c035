"""Which keys clients wrote or deleted here recently, so a handover never undoes them.

During a handover the previous owner pushes its copies to the new owner while clients already
write and delete there. Two things could then bring back an older value:

* a pushed copy landing after a client's newer write or delete (the push overwrites it, or
  recreates the deleted key);
* a client's read missing here (the key was deleted here, or written and then evicted) and
  falling back to the previous owner, which still holds the old copy.

So the daemon notes every key a client writes or deletes (``touch``, before the write takes
effect); a pushed copy is stored only if the key is neither touched nor present, checked and
stored under one lock (``admit``); and a read that misses a touched key tells the client not to
fall back (``touched``). Entries are kept while a handover is open in this daemon's view and for
``ttl_s`` after their write otherwise (a push can arrive before this daemon has heard of the
handover). Past ``cap`` entries the log stops vouching for anything: every push is refused and
every miss is final until it has been empty for ``ttl_s`` (a cache may forget, never lie).

A client's clear of a whole namespace (``touch_namespace``) touches every key of it at once, kept
the same way: a pushed copy of any key of it is refused, a miss of any key of it is final.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

Key = tuple[str, bytes]


class TouchLog:
    def __init__(self, ttl_s: float = 30.0, cap: int = 1_000_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.cap, self._clock = ttl_s, cap, clock
        self._lock = threading.Lock()
        self._when: OrderedDict[Key, float] = OrderedDict()  # oldest first
        self._cleared: OrderedDict[str, float] = OrderedDict()  # namespace -> when a client last cleared it, oldest first
        self._overflow_at: float | None = None
        self.handover_open = False
        self.refused = 0  # pushed copies not stored because a client got there first

    def touch(self, key: Key) -> None:
        now = self._clock()
        with self._lock:
            self._when[key] = now
            self._when.move_to_end(key)
            if len(self._when) > self.cap:
                self._when.clear()
                self._overflow_at = now
            self._prune(now)

    def touch_namespace(self, ns: str) -> None:
        """``touch`` of every key of namespace ``ns`` (a clear), before it takes effect."""
        now = self._clock()
        with self._lock:
            self._cleared[ns] = now
            self._cleared.move_to_end(ns)
            if len(self._cleared) > self.cap:
                self._cleared.clear()
                self._when.clear()
                self._overflow_at = now
            self._prune(now)

    def touched(self, key: Key) -> bool:
        with self._lock:
            return self._overflowed() or key in self._when or key[0] in self._cleared

    def admit(self, key: Key, present: Callable[[Key], bool], store: Callable[[], None]) -> bool:
        """Store a pushed copy (``store()``) unless a client touched the key or it is present;
        False when refused. Atomic with ``touch``: a write either precedes the check or follows
        the store (and then overwrites the pushed copy)."""
        with self._lock:
            if self._overflowed() or key in self._when or key[0] in self._cleared or present(key):
                self.refused += 1
                return False
            store()
            return True

    def set_handover_open(self, is_open: bool) -> None:
        with self._lock:
            self.handover_open = is_open
            self._prune(self._clock())

    def distrust(self) -> None:
        """Vouch for nothing, as after an overflow: a daemon restarted while its incarnation
        stayed up kept its data but lost this log of what clients wrote and deleted here before,
        so a pushed copy could bring back a key a client deleted."""
        with self._lock:
            self._when.clear()
            self._overflow_at = self._clock()

    def clear(self) -> None:
        """Forget every entry (the daemon dropped its data: what clients wrote before is gone)."""
        with self._lock:
            self._when.clear()
            self._cleared.clear()
            self._overflow_at = None

    def __len__(self) -> int:
        return len(self._when)

    def _overflowed(self) -> bool:
        at = self._overflow_at
        if at is None:
            return False
        if self.handover_open or self._clock() - at <= self.ttl_s:
            return True
        self._overflow_at = None
        return False

    def _prune(self, now: float) -> None:
        if self.handover_open:
            return
        while self._cleared:  # oldest first, like _when: a touch costs what it prunes, not the whole map
            ns, t = next(iter(self._cleared.items()))
            if now - t <= self.ttl_s:
                break
            del self._cleared[ns]
        while self._when:
            key, t = next(iter(self._when.items()))
            if now - t <= self.ttl_s:
                break
            del self._when[key]
