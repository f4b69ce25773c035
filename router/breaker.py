"""Per-worker circuit breaker: pure, clock passed in.

CLOSED: requests flow; ``failures`` consecutive failures (5xx answers, timeouts, broken
connections) open the circuit. OPEN: the worker gets no requests for ``open_s`` seconds.
Then HALF-OPEN: requests flow again; the next success closes the circuit, the next failure
opens it for another ``open_s``. The state backends keep one ``Circuit`` per worker
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

    def is_open(self, now: float) -> bool:
        return now < self.open_until

    def record(self, ok: bool, now: float, cfg: BreakerConfig) -> None:
        if ok:
            self.fails = 0
            self.open_until = 0.0
            return
        self.fails += 1
        if self.fails >= cfg.failures:
            self.open_until = now + cfg.open_s
