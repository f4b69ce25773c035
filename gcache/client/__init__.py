from gcache.client.client import Client, GetResult, OnNodeError

__all__ = ["Client", "GetResult", "OnNodeError"]
