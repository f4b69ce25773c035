"""Moving device (GPU) tensors through a host transport: a pool of pinned staging buffers.

When the transport cannot read or write device memory itself, values are staged: device to
host copies into a pinned buffer, then the network; or the network into a pinned buffer, then
host to device. The pool holds a few buffers and pipelines them, so the device copy of one
chunk overlaps the network transfer of the previous one. Values are grouped into chunks that
fit one buffer; chunks are issued in key order and every key is accounted for exactly once.

Only the device copies need a GPU. Here they are done by a Copier: TorchCopier uses a CUDA
stream with non_blocking copies when the tensor is on a GPU (buffers pinned), and plain copies
for CPU tensors (buffers not pinned: torch cannot pin without a driver) -- so ordering,
chunking and completeness are tested on this machine with CPU tensors, and the GPU path runs
unchanged on a GPU host (`gcache bench gpu-check`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.errors import ConfigError
from gcache.protocol import Status

if TYPE_CHECKING:
    from gcache.client.client import Client


_HOST_TYPES = frozenset({bytes, bytearray, memoryview, np.ndarray})  # never on a device: no module check


def is_device_tensor(obj: Any) -> bool:
    """A torch tensor or cupy array that lives on a GPU."""
    if type(obj) in _HOST_TYPES:
        return False
    mod = type(obj).__module__
    if mod.startswith("torch"):
        return bool(obj.device.type != "cpu")
    return mod.startswith("cupy")


class TorchCopier:
    """Device <-> host copies with torch; asynchronous on a CUDA stream when there is one."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None  # type: ignore[no-untyped-call]

    def host_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.cuda)

    def _bytes(self, t: Any) -> Any:
        if not t.is_contiguous():
            raise ValueError("tensor is not contiguous; call .contiguous() first")
        return t.reshape(-1).view(self.torch.uint8)

    def to_host(self, src: Any, host: Any) -> None:
        flat = self._bytes(src)
        if self.stream is not None and flat.is_cuda:
            with self.torch.cuda.stream(self.stream):
                host[: flat.numel()].copy_(flat, non_blocking=True)
        else:
            host[: flat.numel()].copy_(flat)

    def to_device(self, host: Any, dst: Any) -> None:
        flat = self._bytes(dst)
        if self.stream is not None and flat.is_cuda:
            with self.torch.cuda.stream(self.stream):
                flat.copy_(host[: flat.numel()], non_blocking=True)
        else:
            flat.copy_(host[: flat.numel()])

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def nbytes(self, t: Any) -> int:
        return int(t.numel() * t.element_size())


@dataclass(frozen=True)
class StagingConfig:
    """buffers: how many staging buffers (>= 2 to overlap copies with the network).
    buffer_bytes: the size of each; a value larger than one buffer is refused."""

    buffers: int = 4
    buffer_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.buffers < 2:
            raise ConfigError("staging needs at least 2 buffers to overlap copies with the network")
        if self.buffer_bytes < 4096:
            raise ConfigError("staging buffers must be at least 4 KiB")


class StagingPool:
    def __init__(self, config: StagingConfig = StagingConfig(), copier: TorchCopier | None = None) -> None:
        self.config = config
        self.copier = copier or TorchCopier()
        self._buffers = [self.copier.host_buffer(config.buffer_bytes) for _ in range(config.buffers)]
        self._lock = threading.Lock()  # one staged batch at a time per pool
        self.chunks_moved = 0

    def chunks(self, sizes: Sequence[int]) -> list[list[int]]:
        """Key indices grouped, in order, into runs that fit one buffer each."""
        out: list[list[int]] = []
        used = self.config.buffer_bytes
        for i, n in enumerate(sizes):
            if n > self.config.buffer_bytes:
                raise ValueError(f"value {i} is {n} bytes, larger than a staging buffer "
                                 f"({self.config.buffer_bytes}); raise StagingConfig.buffer_bytes")
            if used + n > self.config.buffer_bytes:
                out.append([])
                used = 0
            out[-1].append(i)
            used += n
        return out

    def _views(self, buf: Any, idxs: list[int], sizes: Sequence[int]) -> list[Any]:
        views, off = [], 0
        for i in idxs:
            views.append(buf[off:off + sizes[i]].numpy())
            off += sizes[i]
        return views

    def put(self, client: Client, keys: Sequence[Any], tensors: Sequence[Any], **kw: Any) -> list[Status]:
        """Stage device tensors to host chunk by chunk and put them; per-key Status. Keyword
        arguments go to Client.put; a list is one value per key, cut along with the keys."""
        sizes = [self.copier.nbytes(t) for t in tensors]
        status: list[Status] = [Status.ERROR] * len(keys)
        with self._lock:
            plan = self.chunks(sizes)
            nbuf = len(self._buffers)
            if plan:
                self._fill(plan[0], self._buffers[0], tensors, sizes)
            for c, idxs in enumerate(plan):
                self.copier.synchronize()  # chunk c is on the host
                if c + 1 < len(plan):  # start the next device->host copy before the network
                    self._fill(plan[c + 1], self._buffers[(c + 1) % nbuf], tensors, sizes)
                views = self._views(self._buffers[c % nbuf], idxs, sizes)
                per_chunk = {k: [v[i] for i in idxs] if isinstance(v, list) else v for k, v in kw.items()}
                for i, st in zip(idxs, client.put([keys[i] for i in idxs], views, **per_chunk)):  # type: ignore[arg-type]
                    status[i] = st
                self.chunks_moved += 1
        return status

    def _fill(self, idxs: list[int], buf: Any, tensors: Sequence[Any], sizes: Sequence[int]) -> None:
        off = 0
        for i in idxs:
            self.copier.to_host(tensors[i], buf[off:off + sizes[i]])
            off += sizes[i]

    def get_into(self, client: Client, keys: Sequence[Any], tensors: Sequence[Any], **kw: Any) -> list[Status]:
        """Get values into host buffers chunk by chunk and copy them to the device tensors; the
        host-to-device copy of a chunk overlaps the network get of the next."""
        sizes = [self.copier.nbytes(t) for t in tensors]
        status: list[Status] = [Status.ERROR] * len(keys)
        with self._lock:
            nbuf = len(self._buffers)
            for c, idxs in enumerate(self.chunks(sizes)):
                if c >= nbuf - 1:
                    self.copier.synchronize()  # the buffer about to be reused has reached the device
                buf = self._buffers[c % nbuf]
                res = client.get_into([keys[i] for i in idxs], self._views(buf, idxs, sizes), **kw)
                off = 0
                for i, st, got in zip(idxs, res.status, res.sizes):
                    status[i] = st if st is not Status.OK or got == sizes[i] else Status.BUFFER_TOO_SMALL
                    if status[i] is Status.OK:
                        self.copier.to_device(buf[off:off + sizes[i]], tensors[i])
                    off += sizes[i]
                self.chunks_moved += 1
            self.copier.synchronize()
        return status
