"""Control-plane RPC plumbing: gRPC with msgpack messages and the cluster token.

The service is declared with grpc's generic handlers, so no generated code is needed: each
method takes and returns a msgpack map. Every call carries the cluster token in the
``x-gcache-token`` metadata; a missing or wrong token is refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import grpc
import msgpack

from gcache.env import resolve_token
from gcache.ratelog import RateLimitedLog

SERVICE = "gcache.Master"
TOKEN_HEADER = "x-gcache-token"
MAX_MSG = 64 << 20
# Reconnect fast after a partition heals: by default a connect attempt may hang for 20 s and the
# backoff between attempts grows to 2 minutes, long enough for a healthy daemon to be declared
# down after a one-second network blip.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MSG), ("grpc.max_receive_message_length", MAX_MSG),
                   ("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)  # refusals are the caller's doing: a flood of them must not flood the log


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False)


def load_token(token_file: str | None) -> str | None:
    """The cluster token: ``token_file``, else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN (None when
    none is set). See gcache.env."""
    return resolve_token(token_file)


def token_ok(expected: str | None, given: str | None) -> bool:
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def guarded(token: str | None, fn: Callable[[dict, grpc.ServicerContext], Any]) -> Callable:
    """Wrap a handler: refuse a bad token, turn a bad request into INVALID_ARGUMENT."""

    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        given = dict(context.invocation_metadata()).get(TOKEN_HEADER)
        if not token_ok(token, given):
            limited.warning("auth", "refused %s from %s: %s cluster token", fn.__name__, context.peer(),
                            "missing" if given is None else "wrong")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
        if not isinstance(request, dict):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request must be a msgpack map")
        try:
            return fn(request, context)
        except (KeyError, TypeError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {exc!r}")

    handler.__name__ = fn.__name__
    return handler


def unary(token: str | None, fn: Callable) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(guarded(token, fn), request_deserializer=unpack,
                                               response_serializer=pack)


def stream(token: str | None, fn: Callable) -> grpc.RpcMethodHandler:
    return grpc.unary_stream_rpc_method_handler(guarded(token, fn), request_deserializer=unpack,
                                                response_serializer=pack)
