"""Control-plane RPC plumbing: gRPC with msgpack messages and the cluster token.

The service is declared with grpc's generic handlers, so no generated code is needed: each
method takes and returns a msgpack map. Every call carries the cluster token in the
``x-gcache-token`` metadata; a missing or wrong token is refused with UNAUTHENTICATED.

A master reads a request's bytes only after its token is checked, and then decodes them under
limits (MAX_REQUEST_BYTES in all, which gRPC enforces before the handler runs, and few fields
per map): a request is a small map of scalars, and decoding an unauthenticated 4 MB array of
nils used to build a 32 MB list per call, which the collector was slow to give back.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import msgpack

from gcache.env import resolve_token
from gcache.meta.fields import cut
from gcache.ratelog import RateLimitedLog

SERVICE = "gcache.Master"
TOKEN_HEADER = "x-gcache-token"
MAX_MSG = 64 << 20  # a reply (a membership of thousands of nodes)
# A request: the largest legitimate one, a Register with a 255-character node id and a HOST:PORT,
# is well under 2 KiB. gRPC refuses a larger one (RESOURCE_EXHAUSTED) before a handler sees it.
MAX_REQUEST_BYTES = 16 << 10
_REQUEST_LIMITS: dict[str, Any] = {
    "raw": False, "strict_map_key": True, "max_map_len": 64, "max_array_len": 64,
    "max_str_len": MAX_REQUEST_BYTES, "max_bin_len": MAX_REQUEST_BYTES, "max_ext_len": 0,
}
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
SERVER_OPTIONS = [("grpc.max_send_message_length", MAX_MSG), ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
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


def decode_request(raw: bytes) -> dict[str, Any]:
    """A request's msgpack map, decoded under limits; ValueError says what is wrong."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"a request of {len(raw)} bytes exceeds {MAX_REQUEST_BYTES}")
    try:
        request = msgpack.unpackb(raw, **_REQUEST_LIMITS)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(f"the request is not msgpack within the limits ({why})") from None
    if not isinstance(request, dict):
        raise ValueError(f"the request must be a msgpack map, not {type(request).__name__}")  # noqa: TRY004
    return request


def _admit(token: str | None, name: str, raw: bytes, context: Any) -> dict[str, Any] | tuple[grpc.StatusCode, str]:
    """The request, decoded once the token is right; else (status, why) to refuse it with."""
    given = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER)
    if not token_ok(token, given):
        limited.warning("auth", "refused %s from %s: %s cluster token", name, context.peer(),
                        "missing" if given is None else "wrong")
        return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token"
    try:
        return decode_request(raw)
    except ValueError as exc:
        limited.warning("undecodable", "refused %s from %s: %s", name, context.peer(), cut(str(exc)))
        return grpc.StatusCode.INVALID_ARGUMENT, cut(f"{name}: {exc}")


async def _refuse_bad(name: str, exc: Exception, context: Any) -> None:
    """A request whose fields a handler could not use (its own checks missed them)."""
    limited.warning("bad-request", "refused %s from %s: %s", name, context.peer(), cut(repr(exc)))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, cut(f"bad request: {exc!r}"))


def rpc_name(fn: Callable[..., Any]) -> str:
    """The RPC a handler serves, by its name: ``handover_done`` -> ``HandoverDone``."""
    return "".join(word.capitalize() for word in fn.__name__.split("_"))


def unary(token: str | None, fn: Callable[[dict[str, Any], Any], Awaitable[Any]]) -> grpc.RpcMethodHandler:
    """A grpc.aio unary handler: refuses a bad token, then decodes the request under limits and
    turns a bad one into INVALID_ARGUMENT. The request arrives as bytes (no deserializer): nothing
    is decoded for a caller without the token."""
    name = rpc_name(fn)

    async def handler(raw: bytes, context: Any) -> Any:
        request = _admit(token, name, raw, context)
        del raw  # an aborted call's traceback keeps this frame: hold nothing large in it
        if isinstance(request, tuple):
            await context.abort(*request)
            return None
        try:
            return await fn(request, context)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            await _refuse_bad(name, exc, context)
            return None

    return grpc.unary_unary_rpc_method_handler(handler, response_serializer=pack_reply)


def stream(token: str | None, fn: Callable[[dict[str, Any], Any], AsyncIterator[Any]]) -> grpc.RpcMethodHandler:
    """A grpc.aio server-streaming handler (an async generator), token checked first."""
    name = rpc_name(fn)

    async def handler(raw: bytes, context: Any) -> AsyncIterator[Any]:
        request = _admit(token, name, raw, context)
        del raw
        if isinstance(request, tuple):
            await context.abort(*request)
            return
        async for item in fn(request, context):
            yield item

    return grpc.unary_stream_rpc_method_handler(handler, response_serializer=pack_reply)
