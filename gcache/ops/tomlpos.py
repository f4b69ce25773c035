"""Where a key sits in a TOML file: ``tomllib`` reports positions only for syntax errors, so
schema errors find their line here, by a light scan of table headers and ``key =`` lines."""

from __future__ import annotations

import re

_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-\"']+)\s*=")
_SYNTAX_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


def key_lines(text: str) -> dict[tuple, int]:
    """(section, ..., key) -> 1-based line. Tables give ``(name,)``, array-of-tables entries
    ``(name, index)``, keys ``(*table, key)``; a table header maps to its own line."""
    lines: dict[tuple, int] = {}
    table: tuple = ()
    counts: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        m = _HEADER.match(line)
        if m and not _KEY.match(line):
            name = m.group(2).replace('"', "").replace("'", "").strip()
            parts = tuple(p.strip() for p in name.split("."))
            if m.group(1) == "[[":
                idx = counts.get(name, 0)
                counts[name] = idx + 1
                table = (*parts, idx)
            else:
                table = parts
            lines.setdefault(table, n)
            continue
        m = _KEY.match(line)
        if m:
            lines.setdefault((*table, m.group(1).strip("\"'")), n)
    return lines


def line_of(lines: dict[tuple, int], path: tuple) -> int:
    """The line of ``path`` or of its nearest enclosing table that has one (1 when none)."""
    for i in range(len(path), 0, -1):
        if path[:i] in lines:
            return lines[path[:i]]
    return 1


def syntax_position(message: str) -> tuple[int, int]:
    m = _SYNTAX_POS.search(message)
    return (int(m.group(1)), int(m.group(2))) if m else (1, 1)
