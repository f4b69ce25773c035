"""gcache: a distributed KV-cache store for LLM inference.

``import gcache`` stays light (no grpc, no torch): the client and what it pulls in load on
first use of ``gcache.Client`` and friends.
"""

from importlib import import_module
from typing import Any

from gcache.errors import (
    CallTimeout,
    ClientClosed,
    ClientForked,
    ConfigError,
    ConnectionFailed,
    GCacheError,
    ProtocolError,
    ServerError,
)
from gcache.protocol import Status

_LAZY = {"Client": "gcache.client", "ClientConfig": "gcache.client", "GetResult": "gcache.client",
         "LocalPath": "gcache.client", "OnNodeError": "gcache.client"}

__all__ = [
    "CallTimeout", "Client", "ClientClosed", "ClientConfig", "ClientForked", "ConfigError", "ConnectionFailed", "GCacheError", "GetResult", "LocalPath",
    "OnNodeError", "ProtocolError", "ServerError", "Status",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gcache' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
