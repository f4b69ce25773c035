"""Control-plane RPC plumbing: gRPC with msgpack messages and the cluster token.

The service is declared with grpc's generic handlers, so no generated code is needed: each
method takes and returns a msgpack map. Every call carries the cluster token in the
``x-gcache-token`` metadata; a missing or wrong token is refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
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
                   ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000),
                   # a watch on a master that stopped answering (SIGSTOP, a dead host) fails within ~12 s
                   ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 2_000),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                   # a watcher's standby connection (MasterClient.prepare) carries no call until its
                   # master fails: grpc would close it after 30 idle minutes
                   ("grpc.client_idle_timeout_ms", 7 * 24 * 3600 * 1000)]
# A client's connections (its membership watch): the same, except that a connection attempt may
# take 2 s. grpc gives an attempt max(min_reconnect_backoff_ms, its backoff) to receive the
# server's SETTINGS; at 200 ms a master taking over the watchers of a failed one could not set up
# connections that fast, and the attempts timed out and started again: 1,700 watches opened at
# once on one master had 2,000-4,000 attempts time out and took 1.9-2.1 s and twice the CPU at
# both ends, against 1.0 s and no attempt timed out at 1 or 2 s. Daemons keep 200 ms (few
# connections, and a heartbeat must get through soon after a partition heals).
CLIENT_CHANNEL_OPTIONS = [(k, 2000 if k == "grpc.min_reconnect_backoff_ms" else v) for k, v in CHANNEL_OPTIONS]
SERVER_OPTIONS = [("grpc.max_send_message_length", MAX_MSG), ("grpc.max_receive_message_length", MAX_MSG),
                  # grpc cancels calls that arrive while more than 1,000 wait for the server to take
                  # them: a burst of reconnecting watchers (a master failed) is far more than that
                  ("grpc.server.max_pending_requests", 1 << 20),
                  ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
                  ("grpc.max_concurrent_streams", 1 << 20),
                  # clients' keepalive pings are welcome (the default answers them with GOAWAY)
                  ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                  ("grpc.http2.max_ping_strikes", 0),
                  ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 10_000)]

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


def pack_reply(obj: Any) -> bytes:
    """Replies are msgpack maps; a reply already encoded (the shared membership) goes as is."""
    return obj if isinstance(obj, bytes) else pack(obj)


def _check(token: str | None, name: str, request: Any, context: Any) -> tuple[grpc.StatusCode, str] | None:
    given = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER)
    if not token_ok(token, given):
        limited.warning("auth", "refused %s from %s: %s cluster token", name, context.peer(),
                        "missing" if given is None else "wrong")
        return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token"
    if not isinstance(request, dict):
        return grpc.StatusCode.INVALID_ARGUMENT, "request must be a msgpack map"
    return None


def unary(token: str | None, fn: Callable[[dict[str, Any], Any], Awaitable[Any]]) -> grpc.RpcMethodHandler:
    """A grpc.aio unary handler: refuses a bad token, turns a bad request into INVALID_ARGUMENT."""

    async def handler(request: Any, context: Any) -> Any:
        refused = _check(token, fn.__name__, request, context)
        if refused:
            await context.abort(*refused)
        try:
            return await fn(request, context)
        except (KeyError, TypeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {exc!r}")

    return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=unpack, response_serializer=pack_reply)


def stream(token: str | None, fn: Callable[[dict[str, Any], Any], AsyncIterator[Any]]) -> grpc.RpcMethodHandler:
    """A grpc.aio server-streaming handler (an async generator), token checked first."""

    async def handler(request: Any, context: Any) -> AsyncIterator[Any]:
        refused = _check(token, fn.__name__, request, context)
        if refused:
            await context.abort(*refused)
        async for item in fn(request, context):
            yield item

    return grpc.unary_stream_rpc_method_handler(handler, request_deserializer=unpack, response_serializer=pack_reply)
