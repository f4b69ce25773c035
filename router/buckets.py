"""Length buckets: worker groups per prompt-length range, so a short request never
waits behind long ones in the same group.

Pure: maps a token count to a bucket index and a worker list to the eligible group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.config import BucketConfig


class HasBucket(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def bucket(self) -> int | None: ...


class BucketMap:
    def __init__(self, cfg: BucketConfig) -> None:
        self.cfg = cfg

    def __repr__(self) -> str:
        return f"BucketMap({list(self.cfg.ranges)})"

    def __len__(self) -> int:
        return len(self.cfg.ranges)

    def bucket_of(self, n_tokens: int) -> int:
        """Index of the range holding n_tokens; prompts beyond the last range go to the last."""
        for i, (lo, hi) in enumerate(self.cfg.ranges):
            if lo <= n_tokens < hi:
                return i
        return len(self.cfg.ranges) - 1

    def group(self, n_tokens: int, workers: Sequence[HasBucket]) -> tuple[int, list[str]]:
        """(bucket used, names of workers that may serve a prompt of n_tokens).

        Workers with bucket None serve every bucket. If the prompt's own bucket has
        no worker, the next larger bucket with one is used (a long-context worker
        can serve a short prompt); failing that the next smaller; failing that none.
        """
        want = self.bucket_of(n_tokens)
        if all(w.bucket is None for w in workers):  # the common case: every worker serves every length
            return want, sorted(w.name for w in workers)
        n = len(self.cfg.ranges)
        order = list(range(want, n)) + list(range(want - 1, -1, -1))
        for b in order:
            names = sorted(w.name for w in workers if w.bucket is None or w.bucket == b)
            if names:
                return b, names
        return want, []
