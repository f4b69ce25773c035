"""Process lifecycle helpers shared by ``gcache daemon``, ``gcache master`` and ``gcache up``."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C): the process stops cleanly when it is set."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(stop: threading.Event, poll_s: float = 1.0) -> None:
    """Block the main thread until ``stop`` is set (by SIGTERM/SIGINT: ``stop_on_signals``).

    The kernel may deliver a process signal to any of its threads; CPython runs the handler in
    the main thread when that thread next runs bytecode, and a main thread blocked in
    ``Event.wait()`` never does: a daemon that was stopped and continued (SIGSTOP/SIGCONT) under
    load ignored SIGTERM until it was killed. Here the C handler, in whatever thread, writes to
    a wakeup fd that the main thread's select waits on, so the handler runs at once (and within
    ``poll_s`` whatever happens)."""
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    old = signal.set_wakeup_fd(w.fileno())
    try:
        while not stop.is_set():
            select.select([r], [], [], poll_s)
            with contextlib.suppress(BlockingIOError):
                while r.recv(4096):
                    pass
    finally:
        signal.set_wakeup_fd(old)
        r.close()
        w.close()


def write_ready(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, so a watcher never reads half of it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
