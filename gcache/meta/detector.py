"""The leader's failure detector (pure: no I/O, the clock is injected).

Every master records when it last heard each node's incarnation (``heard``). Only the leader acts:
``verdicts`` compares each owning node's silence with the thresholds and returns the state
changes to propose (UP -> SUSPECT -> DOWN, and back to UP once heard again; a DRAINING node
silent past the DOWN threshold is removed (REMOVE), as a completed drain would be, so that its
handover, which waits for its report, closes: before, a draining node that hung kept the handover
open, and every read of its keys waiting on it, until it resumed. The table's ``remove`` command,
which every master version applies alike, not a new state change: masters of two versions
during a rolling upgrade would otherwise apply the same log differently). Grace periods:

* a new leader counts silence from when it became leader, never from before;
* so does a leader that did not run for a while (paused or starved past PAUSE_S: it heard
  nothing meanwhile, and may have lost the leadership without knowing yet; before this, a
  leader continued after a SIGSTOP declared every live node DOWN);
* an incarnation this master has not heard from yet (a node that registered through another
  master, or just re-registered) gets a full grace period from when it is first seen here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gcache.errors import ConfigError

OWNING = ("up", "suspect")
REMOVE = "remove"  # a Verdict's state for a draining node that went silent: removed from the table


@dataclass(frozen=True)
class Verdict:
    node: str
    inc: int
    state: str  # the state to propose
    silent_s: float


PAUSE_S = 1.0  # verdicts() is called every 0.1 s; a gap this long means this master did not run


class FailureDetector:
    def __init__(self, suspect_after_s: float, down_after_s: float,
                 clock: Callable[[], float] = time.monotonic, pause_s: float | None = PAUSE_S) -> None:
        """``pause_s``: a gap between two verdicts() calls longer than this is a pause (None:
        never; for tests that step the clock by seconds between calls)."""
        if not 0 < suspect_after_s < down_after_s:
            raise ConfigError("need 0 < suspect_after < down_after")
        self.suspect_after_s, self.down_after_s = suspect_after_s, down_after_s
        self.pause_s = pause_s
        self.clock = clock
        self._seen: dict[str, tuple[int, float]] = {}  # node -> (incarnation, when heard)
        self._leader_since: float | None = None
        self._last_verdicts: float | None = None  # when verdicts() last ran (a pause shows as a gap)
        self._lock = threading.Lock()  # heartbeats may arrive on other threads than the detector's

    def heard(self, node: str, inc: int) -> None:
        """A heartbeat (or registration) of ``node`` incarnation ``inc`` arrived now (one from an
        older incarnation than the newest heard is ignored)."""
        now = self.clock()
        with self._lock:
            seen = self._seen.get(node)
            if seen is None or inc >= seen[0]:
                self._seen[node] = (inc, now)

    def leadership(self, is_leader: bool) -> bool:
        """Tell the detector whether this master leads; True when it has just become leader."""
        with self._lock:
            if not is_leader:
                self._leader_since = None
                return False
            if self._leader_since is None:
                self._leader_since = self.clock()
                return True
            return False

    def verdicts(self, nodes: Iterable[tuple[str, int, str]]) -> list[Verdict]:
        """State changes to propose for ``(node, incarnation, state)`` rows of the table; none
        unless this master leads. Forgets nodes that are no longer in the table."""
        now = self.clock()
        out: list[Verdict] = []
        with self._lock:
            last, self._last_verdicts = self._last_verdicts, now
            if self._leader_since is None:
                return out
            if self.pause_s is not None and last is not None and now - last > self.pause_s:
                # this master was paused or starved (SIGSTOP, a VM stall): what it did not hear
                # meanwhile says nothing about the nodes, and it may no longer lead (a verdict
                # would still be forwarded to the new leader): a full grace period, as for a new leader
                self._leader_since = now
                return out
            present = set()
            for node, inc, state in nodes:
                present.add(node)
                if state not in OWNING and state != "draining":
                    continue
                seen = self._seen.get(node)
                if seen is None or seen[0] != inc:  # not heard from this incarnation yet: full grace
                    self._seen[node] = (inc, now)
                    continue
                silent = now - max(seen[1], self._leader_since)
                if state == "draining":  # owns nothing: only a silent one matters (its handover waits on it)
                    if silent > self.down_after_s:
                        out.append(Verdict(node, inc, REMOVE, silent))
                    continue
                target = ("down" if silent > self.down_after_s
                          else "suspect" if silent > self.suspect_after_s else "up")
                if target != state:
                    out.append(Verdict(node, inc, target, silent))
            for gone in set(self._seen) - present:
                del self._seen[gone]
        return out

    def ages(self) -> dict[str, float]:
        """Seconds since each node was last heard (for status)."""
        now = self.clock()
        with self._lock:
            return {n: round(now - t, 3) for n, (_inc, t) in self._seen.items()}
