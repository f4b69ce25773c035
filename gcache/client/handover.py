"""The put function a daemon hands its keys over with (gcache.server.handover.PutFn): the gcache
client over TCP (the receiver checks each pushed copy), one client kept across batches and
moved to each handover's membership."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from gcache.client.client import Client
from gcache.client.config import ClientConfig, LocalPath, OnNodeError
from gcache.meta.membership import Membership
from gcache.protocol import Status
from gcache.tier.valuemeta import ValueMeta


class ClientPut:
    def __init__(self, token: str | None, timeout_s: float = 10.0, sender: str | None = None) -> None:
        self.sender = sender  # this node's id, sent with each copy (the receiver checks it is handing over)
        self.config = ClientConfig(token=token, timeout_s=timeout_s, on_node_error=OnNodeError.MISS,
                                   local=LocalPath.OFF)
        self._client: Client | None = None
        self._lock = threading.Lock()

    def __call__(self, membership: Membership, ns: str, pool: str | None, keys: Sequence[bytes],
                 values: Sequence[memoryview], records: Sequence[ValueMeta]) -> list[Status]:
        with self._lock:
            if self._client is None:
                self._client = Client(membership, self.config)
            else:
                self._client.update_membership(membership)
            client = self._client
        return client.put(keys, values, namespace=ns, pool=pool, pos=[m.pos for m in records],
                          tail=[m.tail for m in records], ttl_s=[m.ttl_s for m in records],
                          fmt=[m.fmt for m in records], handover=self.sender or True)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
