"""Checks of the numbers the gcache commands take (durations, ports, counts, sizes), and the
argparse types built on them, so a bad value is refused with one clear line before anything
starts: ``gcache daemon: error: argument --heartbeat: must be a finite number of seconds > 0,
got nan``.

The ``*_error`` functions say why a value is bad (None when it is good); the config file
(gcache.ops.config) and the daemon's own checks use them on values that did not come through
argparse.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, TypeVar

from gcache.errors import ConfigError
from gcache.sizes import parse_size

MAX_PORT = 65535
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
T = TypeVar("T")


def seconds_error(value: Any, zero_ok: bool = False, minimum: float | None = None,
                  maximum: float | None = None) -> str | None:
    """Why ``value`` is not a duration: a finite number of seconds > 0 (>= 0 with ``zero_ok``,
    >= ``minimum`` when given; <= ``maximum`` when given)."""
    want = f"a finite number of seconds {'>= 0' if zero_ok else '> 0'}"
    if minimum is not None:
        want = f"a finite number of seconds >= {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected {want}, got {value!r}"
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok) or (
            minimum is not None and value < minimum):
        return f"must be {want}, got {value!r}"
    if maximum is not None and value > maximum:
        return f"must be at most {maximum:g} seconds, got {value!r}"
    return None


def port_error(value: Any) -> str | None:
    """Why ``value`` is not a port number (0..65535; 0 picks a free one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PORT:
        return f"expected a port number 0-{MAX_PORT}, got {value!r}"
    return None


def count_error(value: Any, minimum: int = 1) -> str | None:
    """Why ``value`` is not a whole number >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return f"expected a whole number >= {minimum}, got {value!r}"
    return None


def _number(text: str, kind: Callable[[str], Any], want: str) -> Any:
    try:
        return kind(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None


def _checked(value: T, err: str | None) -> T:
    if err:
        raise argparse.ArgumentTypeError(err)
    return value


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    v: float = _number(text, float, "a number of seconds")
    return _checked(v, seconds_error(v))


def seconds_at_least(minimum: float) -> Callable[[str], float]:
    """argparse type: a finite number of seconds >= ``minimum`` (> 0)."""

    def parse(text: str) -> float:
        v: float = _number(text, float, "a number of seconds")
        return _checked(v, seconds_error(v, minimum=minimum))

    return parse


def seconds_or_zero(text: str) -> float:
    """argparse type: a finite number of seconds >= 0 (0 usually means 'never' or 'off')."""
    v: float = _number(text, float, "a number of seconds")
    return _checked(v, seconds_error(v, zero_ok=True))


def port(text: str) -> int:
    """argparse type: a port number 0..65535."""
    v: int = _number(text, int, f"a port number 0-{MAX_PORT}")
    return _checked(v, port_error(v))


def count(text: str) -> int:
    """argparse type: a whole number >= 1."""
    v: int = _number(text, int, "a whole number")
    return _checked(v, count_error(v))


def count_or_zero(text: str) -> int:
    """argparse type: a whole number >= 0."""
    v: int = _number(text, int, "a whole number")
    return _checked(v, count_error(v, 0))


def positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    v: float = _number(text, float, "a number")
    return _checked(v, None if math.isfinite(v) and v > 0 else f"expected a finite number > 0, got {text!r}")


def fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    v: float = _number(text, float, "a number between 0 and 1")
    return _checked(v, None if 0 < v < 1 else f"expected a number between 0 and 1 (exclusive), got {text!r}")


def size(text: str) -> str:
    """argparse type: a size such as 512MiB (gcache.sizes), checked and kept as written."""
    try:
        parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def log_level(text: str) -> str:
    """argparse type: a logging level name, any case (returned upper-case)."""
    if text.strip().upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected a log level ({', '.join(LOG_LEVELS)}), got {text!r}")
    return text.strip().upper()
