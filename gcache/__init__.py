"""gcache: a distributed KV-cache store for LLM inference."""

from gcache.client import Client, GetResult, LocalPath, OnNodeError
from gcache.errors import (
    CallTimeout,
    ConfigError,
    ConnectionFailed,
    GCacheError,
    ProtocolError,
    ServerError,
)
from gcache.protocol import Status

__all__ = [
    "CallTimeout", "Client", "ConfigError", "ConnectionFailed", "GCacheError", "GetResult", "LocalPath",
    "OnNodeError", "ProtocolError", "ServerError", "Status",
]
__version__ = "0.1.0"
