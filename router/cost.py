"""The router's estimate of a worker's prefill time, the unit its load is kept in.

Prefill time for T uncached tokens on a reference worker (NVIDIA Dynamo mocker's fit,
H100-class GPU, ~8B-70B dense model; quadratic because attention is)::

    prefill_ms(T) = a * T^2 + b * T + c        (a = 4.21e-7, b = 1.52e-2, c = 16.5)

A worker's pending work is the sum of these estimates over the requests sent to it
that have not produced a first byte yet; a worker with ``speed`` 2 does it in half the
time. Tokens that can be loaded from a shared L3 tier instead of recomputed cost
``l3_ms_per_token`` each (a transfer, not a prefill). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_A_MS = 4.21e-7
PREFILL_B_MS = 1.52e-2
PREFILL_C_MS = 16.5


@dataclass(frozen=True)
class PrefillCost:
    a_ms: float = PREFILL_A_MS
    b_ms: float = PREFILL_B_MS
    c_ms: float = PREFILL_C_MS
    l3_ms_per_token: float = 1.0e-3

    def __post_init__(self) -> None:
        for name in ("a_ms", "b_ms", "c_ms", "l3_ms_per_token"):
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"PrefillCost.{name} must be >= 0, got {v}")

    def ms(self, uncached_tokens: int, l3_tokens: int = 0) -> float:
        """Estimated prefill time of a request with ``uncached_tokens`` to compute and
        ``l3_tokens`` to load (tokens already on the worker cost nothing, as in the fit)."""
        t = float(max(0, uncached_tokens))
        return self.a_ms * t * t + self.b_ms * t + self.c_ms + self.l3_ms_per_token * max(0, l3_tokens)

    def work(self, uncached_tokens: int, l3_tokens: int = 0) -> int:
        """``ms`` rounded to a positive integer: the unit state backends add and subtract."""
        return max(1, round(self.ms(uncached_tokens, l3_tokens)))
