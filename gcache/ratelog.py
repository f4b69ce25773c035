"""Rate-limited logging for events a peer can trigger at will (refused requests and tokens,
half-sent frames, shed connections): a flood of them must not flood the log.

Each kind of event (a ``key``) may log ``burst`` lines per ``window_s``; further ones in the
window are counted, and the next line of that kind after the window says how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, burst: int = 5, window_s: float = 10.0) -> None:
        if burst < 1 or window_s <= 0:
            raise ValueError("burst must be >= 1 and window_s > 0")
        self.logger, self.burst, self.window_s = logger, burst, window_s
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # key -> [window start, lines logged in it, left out]

    def __repr__(self) -> str:
        return f"RateLimitedLog({self.logger.name!r}, burst={self.burst}, window_s={self.window_s})"

    def log(self, level: int, key: str, msg: str, *args: Any, exc_info: bool = False,
            now: float | None = None) -> bool:
        """Log unless ``key`` has used its burst in this window; returns whether it logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = time.monotonic() if now is None else now
        with self._lock:
            kind = self._kinds.get(key)
            if kind is None or now - kind[0] >= self.window_s:
                left_out = kind[2] if kind is not None else 0
                kind = self._kinds[key] = [now, 0, 0]
            else:
                left_out = 0
            if kind[1] >= self.burst:
                kind[2] += 1
                return False
            kind[1] += 1
        if left_out:
            msg += f" ({left_out} more like this in the previous {self.window_s:g}s were not logged)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: Any, **kw: Any) -> bool:
        return self.log(logging.WARNING, key, msg, *args, **kw)

    def info(self, key: str, msg: str, *args: Any, **kw: Any) -> bool:
        return self.log(logging.INFO, key, msg, *args, **kw)

    def error(self, key: str, msg: str, *args: Any, **kw: Any) -> bool:
        return self.log(logging.ERROR, key, msg, *args, **kw)
