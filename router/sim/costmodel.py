"""Prefill/decode cost model of a simulated worker.

Prefill time is NVIDIA Dynamo's mocker fit, quadratic in uncached tokens T
(components/backends/mocker, H100-class GPU, ~8B-70B dense model):

    prefill_ms(T) = 4.21e-7 * T^2 + 1.52e-2 * T + 16.5

Decode: time per output token grows with the decode batch,
``tpot_ms(b) = decode_base_ms + decode_per_seq_ms * b`` (defaults 15 ms + 0.3 ms/seq,
a typical continuous-batching curve; an assumption, not a fit). Prefills on a
worker run one at a time in arrival order; decodes run concurrently beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.cost import PREFILL_A_MS, PREFILL_B_MS, PREFILL_C_MS


@dataclass(frozen=True)
class CostModel:
    prefill_a: float = PREFILL_A_MS  # ms / token^2
    prefill_b: float = PREFILL_B_MS  # ms / token
    prefill_c: float = PREFILL_C_MS  # ms
    decode_base_ms: float = 15.0
    decode_per_seq_ms: float = 0.3

    def __post_init__(self) -> None:
        for name in ("prefill_a", "prefill_b", "prefill_c", "decode_base_ms", "decode_per_seq_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")

    def prefill_s(self, uncached_tokens: int) -> float:
        t = float(uncached_tokens)
        return (self.prefill_a * t * t + self.prefill_b * t + self.prefill_c) / 1000.0

    def decode_s(self, output_tokens: int, batch: int) -> float:
        return output_tokens * (self.decode_base_ms + self.decode_per_seq_ms * batch) / 1000.0
