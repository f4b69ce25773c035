from gcache.client.client import ClearResult, Client, GetResult
from gcache.client.config import ClientConfig, LocalPath, OnNodeError

__all__ = ["ClearResult", "Client", "ClientConfig", "GetResult", "LocalPath", "OnNodeError"]
