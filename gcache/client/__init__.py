from gcache.client.client import Client, GetResult, LocalPath, OnNodeError

__all__ = ["Client", "GetResult", "LocalPath", "OnNodeError"]
