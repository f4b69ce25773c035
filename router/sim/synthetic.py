"""Synthetic traces for the simulator (Mooncake record format)."""

from __future__ import annotations

from gcache.mooncake_trace import TraceRequest


def hot_prefix(n: int = 400, rate_per_s: float = 100.0, shared_blocks: int = 10, unique_blocks: int = 1,
               output_tokens: int = 32, block_tokens: int = 512) -> list[TraceRequest]:
    """``n`` requests at a steady ``rate_per_s`` that all share the same ``shared_blocks``
    leading blocks (a long system prompt) followed by ``unique_blocks`` of their own."""
    if n <= 0 or rate_per_s <= 0 or shared_blocks < 0 or unique_blocks < 0:
        raise ValueError("hot_prefix needs n > 0, rate_per_s > 0 and non-negative block counts")
    shared = tuple(range(1, shared_blocks + 1))
    out = []
    for i in range(n):
        own = tuple(1_000_000 + i * unique_blocks + j for j in range(unique_blocks))
        out.append(TraceRequest(i * 1000.0 / rate_per_s, (shared_blocks + unique_blocks) * block_tokens,
                                output_tokens, shared + own))
    return out
