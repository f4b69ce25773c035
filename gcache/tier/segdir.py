"""The NVMe tier directory's own files: the lock that keeps a second daemon out, and the segment
map that lets a restart notice a segment that is missing, truncated or already reclaimed.

``tier.lock``: an exclusive ``fcntl.lockf`` lock, held while the tier is open. POSIX locks
belong to the process: a second process (another daemon) is refused, the kernel drops the lock
when its holder dies however it dies, and a second tier in the same process is not refused (the
in-process tests reopen a directory to play a restart after a crash).

``tier.segs``: the segment map. Its first line is ``FLOOR NEWEST``: segment files with an id
below FLOOR were reclaimed (a restart ignores and removes them), and every id from FLOOR to
NEWEST has a file. Each further line is ``ID SIZE``: a sealed segment (no appends any more) and
the size its file has. Replaced atomically (temporary file, rename) when a segment is created or
reclaimed, before anything depends on it, and not fsync'd then: like the segments themselves it
has to survive a process crash, which the page cache does; after a machine crash the tier keeps
nothing unless it was stopped cleanly (gcache.tier.nvme), and a clean stop writes it durably
(fsync of the file and of the directory). An fsync while running would be taken under the
store's lock, and on a busy disk one can take as long as flushing every dirty segment page.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field

from gcache.errors import ConfigError

LOCK_FILE = "tier.lock"
MAP_FILE = "tier.segs"


class DirectoryInUse(ConfigError):
    """Another process (a gcache daemon) holds the tier directory's lock."""


def lock(directory: str) -> int:
    """Take the directory's lock; the open fd holds it (close it to release). DirectoryInUse if
    another process holds it."""
    path = os.path.join(directory, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DirectoryInUse(f"disk directory {directory!r} is in use by another gcache daemon (it holds "
                             f"{path}); stop that daemon or give this one another --disk") from None
    return fd


@dataclass
class SegMap:
    floor: int  # lowest id not reclaimed
    newest: int  # highest id created
    sizes: dict[int, int] = field(default_factory=dict)  # sealed segment id -> its file's size

    def encode(self) -> str:
        return "".join([f"{self.floor} {self.newest}\n", *(f"{i} {n}\n" for i, n in sorted(self.sizes.items()))])


def load_map(directory: str) -> SegMap | None:
    """The segment map; None if there is none or it cannot be read (then nothing is known)."""
    try:
        with open(os.path.join(directory, MAP_FILE)) as f:
            pairs = [_pair(line) for line in f]
    except (OSError, ValueError):
        return None
    if not pairs:
        return None
    (floor, newest), sizes = pairs[0], dict(pairs[1:])
    return SegMap(floor, newest, sizes)


def _pair(line: str) -> tuple[int, int]:
    a, b = line.split()  # ValueError unless two fields
    return int(a), int(b)


def save_map(directory: str, segmap: SegMap, durable: bool = False) -> None:
    write_atomically(directory, MAP_FILE, segmap.encode(), durable)


def write_atomically(directory: str, name: str, text: str, durable: bool = True) -> None:
    """Replace ``directory/name`` with ``text`` atomically (a crash leaves the old text or the
    new); ``durable``: also fsync'd, file and directory, so a power cut keeps it."""
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if not durable:
        return
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
