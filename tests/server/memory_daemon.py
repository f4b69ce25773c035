"""Daemons served in this process over in-memory streams (gcache.transport.memory): the real
Handler and Store, no sockets, no processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from gcache.net.stream import Stream
from gcache.server.handler import Handler, ServerContext
from gcache.tier.store import Store, StoreConfig
from gcache.transport import memory


def serve_then_close(handler: Handler) -> None:
    """What the daemon's servers do with each connection: serve it, then close it."""
    try:
        handler.serve()
    finally:
        handler.stream.close()


class MemoryDaemon:
    def __init__(self, address: str, token: str | None = None, mem_bytes: int = 16 << 20) -> None:
        self.address = address
        self.store = Store(StoreConfig(mem_bytes=mem_bytes, pretouch=False))
        self.ctx = ServerContext(self.store, address, 1 << 30, token)
        self.streams: list[Stream] = []
        memory.listen(address, self._accept)

    def _accept(self, stream: Stream) -> None:
        self.streams.append(stream)
        threading.Thread(target=serve_then_close, args=(Handler(stream, self.ctx),), daemon=True).start()

    def kill(self) -> None:
        """Stop accepting and drop every connection (as a dead daemon would)."""
        memory.unlisten(self.address)
        for s in self.streams:
            s.close()

    def close(self) -> None:
        self.kill()
        self.store.close()


@contextmanager
def memory_cluster(n: int, token: str | None = None, tag: str = "m",
                   mem_bytes: int = 16 << 20) -> Iterator[list[MemoryDaemon]]:
    daemons = [MemoryDaemon(f"{tag}-{i}:1", token, mem_bytes) for i in range(n)]
    try:
        yield daemons
    finally:
        for d in daemons:
            d.close()
