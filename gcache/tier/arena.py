"""Shared-memory arena: one memfd per daemon, mapped once, sized at start-up.

The memfd can be handed to a local client over a Unix socket (SCM_RIGHTS) so it maps the very
same pages; that is why the RAM tier lives in shared memory from day one.
"""

from __future__ import annotations

import mmap
import os

from gcache.errors import ConfigError


class Arena:
    def __init__(self, size: int, *, name: str = "gcache-arena", pretouch: bool = True) -> None:
        if size < 4096:
            raise ConfigError(f"arena size {size} is too small; give at least 4 KiB (e.g. --mem 256MiB)")
        self.size = size
        self.fd = os.memfd_create(name, 0)
        try:
            os.ftruncate(self.fd, size)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if pretouch else 0)
            self._mmap = mmap.mmap(self.fd, size, flags=flags)
        except OSError as exc:
            os.close(self.fd)
            raise ConfigError(f"cannot map a {size}-byte arena ({exc}); lower --mem") from None
        self.view = memoryview(self._mmap)

    def slot(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]

    def close(self) -> None:
        """Unmap, unless slot views are still exported (then the mapping lives until they go)."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            pass
        os.close(self.fd)
