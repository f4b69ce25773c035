"""The one parser of human-readable sizes: bytes ('64KiB', '4GiB', '1.5GB', '4096') and token
counts ('64K', '1M').

Two unit sets, because the two quantities are quoted differently:

* bytes (:func:`parse_size`): IEC units are powers of 1024 (``KiB``, ``MiB``, ``GiB``, ``TiB``),
  SI units powers of 1000 (``k``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB``), a bare number
  or ``B`` is bytes;
* token counts (:func:`parse_tokens`): ``K`` = 1024 and ``M`` = 1024**2, as context lengths are
  quoted ("a 128K context" = 131,072 tokens).

Units are case-insensitive, whitespace around the number and unit is ignored, and fractions are
allowed (``1.5GiB``, ``.5K``) and rounded down to a whole number. Negative numbers, exponents,
booleans and anything else raise :class:`gcache.errors.ConfigError` (a ValueError) that quotes
the input and gives examples.
"""

from __future__ import annotations

import re

from gcache.errors import ConfigError

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_TOKEN_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def _parse(text: object, units: dict[str, int], what: str, examples: str) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"cannot read {what} {text!r}: must be >= 0")
        return text
    m = _RE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if not m or unit not in units:
        raise ConfigError(f"cannot read {what} {text!r}; use e.g. {examples}")
    return int(float(m.group(1)) * units[unit])


def parse_size(text: str | int) -> int:
    """Bytes from ``'64KiB'``-style text (see the module docstring), or a non-negative int as is."""
    return _parse(text, _BYTE_UNITS, "size", "4096, 64KiB, 512MiB, 4GiB, 1.5GB")


def parse_tokens(text: str | int) -> int:
    """A token count from ``'64K'``-style text: K = 1024, M = 1024**2; or a non-negative int as is."""
    return _parse(text, _TOKEN_UNITS, "token count", "4096, 64K, 1M")


def format_size(n: float) -> str:
    """``n`` bytes in IEC units with one decimal ('1.5MiB'); below 1 KiB, whole bytes ('512B')."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"
