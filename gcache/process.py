"""Process lifecycle helpers shared by ``gcache daemon``, ``gcache master`` and ``gcache up``."""

from __future__ import annotations

import os
import signal
import threading


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C): the process stops cleanly when it is set."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def write_ready(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, so a watcher never reads half of it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
