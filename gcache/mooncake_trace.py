"""Mooncake-format request traces: the one reader behind ``gcache bench`` and ``gcache-router sim``.

A trace is JSON lines, one request a line (the format of the conversation trace released with
Mooncake's FAST'25 paper)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

Units, as the reader keeps them:

* ``timestamp``: arrival in **milliseconds** from the start of the trace (``TraceRequest.timestamp_ms``;
  ``arrival_s`` gives seconds);
* ``input_length`` / ``output_length``: **tokens** of the prompt / of the answer;
* ``hash_ids``: one **block id** per ``block_tokens``-token block of the prompt (512 in Mooncake's
  traces, ``BLOCK_TOKENS``), so ``len(hash_ids) == ceil(input_length / block_tokens)``; the last
  block may be partial. Equal ids at the same position mean the same prefix up to and including
  that block (prefix chains). Ids are opaque integers, not hashes of anything we can recompute.

Requests must come in arrival order (timestamps never decrease), so "the first N requests" of a
trace is one thing: the first N in the file, which are also the first N to arrive.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
#: The conversation trace beside the repository (``../shared/data`` of a checkout), if present.
DEFAULT_TRACE = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                              "conversation_trace.jsonl"))


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file, line and problem."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; see the module docstring for the units."""

    timestamp_ms: float
    input_length: int  # tokens
    output_length: int  # tokens
    hash_ids: tuple[int, ...]  # one id per block of the prompt

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def prefix_tokens(self, blocks: int, block_tokens: int = BLOCK_TOKENS) -> int:
        """Input tokens covered by the first ``blocks`` blocks (the last block may be partial)."""
        return min(self.input_length, blocks * block_tokens)


def parse_line(line: str, lineno: int = 0, block_tokens: int = BLOCK_TOKENS, where: str = "trace") -> TraceRequest:
    """One trace line as a request. Raises TraceError naming ``where`` and ``lineno`` when a field is
    missing or of the wrong type, a count is negative, or the number of block ids does not
    match ``input_length`` at ``block_tokens`` tokens a block."""
    try:
        d = json.loads(line)
        ts, inp, out, ids = d["timestamp"], d["input_length"], d.get("output_length", 0), d["hash_ids"]
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(ids, list):
            raise TypeError("timestamp must be a number and hash_ids a list")
        for v in (inp, out, *ids):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{v!r} is not an integer (input_length, output_length, hash_ids)")
        req = TraceRequest(ts, inp, out, tuple(ids))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TraceError(f"{where} line {lineno}: not a Mooncake trace record ({exc!r})") from None
    if req.timestamp_ms < 0 or req.input_length < 0 or req.output_length < 0:
        raise TraceError(f"{where} line {lineno}: timestamp, input_length and output_length must be >= 0")
    need = -(-req.input_length // block_tokens)
    if len(req.hash_ids) != need:
        raise TraceError(f"{where} line {lineno}: {len(req.hash_ids)} hash_ids for {req.input_length} tokens "
                         f"(expected {need} blocks of {block_tokens})")
    return req


def load_trace(path: str | Path, limit: int | None = None, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """The first ``limit`` requests of the JSONL trace at ``path``, in file (= arrival) order.

    ``limit`` counts requests, not lines: blank lines are skipped and not counted, and the file is
    read only as far as needed. ``None`` or ``0`` reads every request (both command lines take
    ``--limit 0`` as "all"); a negative limit is a ValueError. Raises TraceError (a ValueError)
    naming the line of a malformed request or of a timestamp earlier than the one before it.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 (0 or None: every request), got {limit}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit and len(out) >= limit:
                break
            if not line.strip():
                continue
            req = parse_line(line, lineno, block_tokens, str(path))
            if out and req.timestamp_ms < out[-1].timestamp_ms:
                raise TraceError(f"{path} line {lineno}: timestamp {req.timestamp_ms} is earlier than the line "
                                 f"before ({out[-1].timestamp_ms}); a trace must be in arrival order")
            out.append(req)
    return out
