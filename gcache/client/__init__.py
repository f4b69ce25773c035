from gcache.client.client import Client, GetResult
from gcache.client.config import ClientConfig, LocalPath, OnNodeError

__all__ = ["Client", "ClientConfig", "GetResult", "LocalPath", "OnNodeError"]
