"""Restart policy of ``gcache up``: exponential backoff per process, reset after a stable run.

Pure (no processes, no clock of its own): the supervisor in ``gcache.cluster`` feeds it exit
times and asks when to restart, so the policy is tested without waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackoffPolicy:
    """First restart after ``initial_s``, then doubling up to ``max_s``; a process that ran
    ``stable_s`` before it died starts again from ``initial_s``."""

    initial_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.stable_s <= 0:
            raise ValueError("need 0 < initial_s <= max_s and stable_s > 0")


@dataclass
class Backoff:
    policy: BackoffPolicy = field(default_factory=BackoffPolicy)
    failures: int = 0  # consecutive short-lived runs

    def delay_after_exit(self, ran_s: float) -> float:
        """Seconds to wait before restarting a process that exited after running ``ran_s``."""
        if ran_s >= self.policy.stable_s:
            self.failures = 0
        delay = min(self.policy.max_s, self.policy.initial_s * (2 ** self.failures))
        self.failures += 1
        return delay
