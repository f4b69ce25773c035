"""Per-worker circuit breaker: pure, clock passed in.

CLOSED: requests flow; ``failures`` consecutive failures (5xx answers, timeouts, broken
connections) open the circuit. OPEN: the worker gets no requests for ``open_s`` seconds.
Then HALF-OPEN: one request at a time is let through (the probe, ``take_probe``); its success
closes the circuit, its failure opens it for another ``open_s``. A probe that ends with no
outcome (the client left) hands the token back (``drop_probe``). The state backends keep one ``Circuit`` per worker
(the Redis backend keeps the same two numbers in Redis, so every replica shares them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 5
    open_s: float = 10.0

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {self.failures}")
        if not self.open_s > 0:
            raise ValueError(f"breaker open_s must be > 0, got {self.open_s}")


@dataclass
class Circuit:
    fails: int = 0  # consecutive failures
    open_until: float = 0.0  # no requests before this time
    probe: object = None  # half-open: the one probe request in flight (its lease)

    def is_open(self, now: float) -> bool:
        """No request may be sent now: open, or half-open with its probe in flight."""
        return now < self.open_until or self.probe is not None

    def half_open(self, now: float) -> bool:
        return self.open_until > 0 and now >= self.open_until

    def take_probe(self, now: float, owner: object) -> bool:
        """May ``owner`` be sent now? In the half-open state only the first caller gets True
        until the probe's outcome is recorded (or it drops the probe)."""
        if self.is_open(now):
            return False
        if self.half_open(now):
            self.probe = owner
        return True

    def drop_probe(self, owner: object) -> None:
        if self.probe is owner:
            self.probe = None

    def record(self, ok: bool, now: float, cfg: BreakerConfig) -> None:
        self.probe = None
        if ok:
            self.fails = 0
            self.open_until = 0.0
            return
        self.fails += 1
        if self.fails >= cfg.failures:
            self.open_until = now + cfg.open_s
