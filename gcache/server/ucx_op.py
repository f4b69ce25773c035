"""The daemon's UCX_CONNECT (``gcache daemon --ucx``): a TCP connection that asks becomes the
set-up and liveness channel of a UCX connection, served on the same thread until it goes away
(gcache.transport.ucx has the protocol of the set-up)."""

from __future__ import annotations

import logging
import socket
from typing import Any

from gcache import protocol as P
from gcache.protocol import ErrorCode, Op
from gcache.server.handler import Handler, Refused, ServerContext

log = logging.getLogger(__name__)


def install(ctx: ServerContext, host: str) -> None:
    """Serve UCX_CONNECT on every TCP connection of the daemon whose context is ``ctx``, for
    clients at ``host`` (the listening address: loopback keeps UCX on ``lo``). Fails now, not at
    the first client, when UCX cannot be used."""
    from gcache.transport.ucx import setup

    setup.worker_for(host)
    ctx.ops[Op.UCX_CONNECT] = lambda handler, req_id, meta: _serve(handler, host, req_id, meta)


def _serve(handler: Handler, host: str, req_id: int, meta: dict[str, Any]) -> None:
    """Answer UCX_CONNECT, then serve this client over UCX on this thread until it goes away."""
    from gcache.transport.ucx import accept

    addr, cid = meta.get("addr"), meta.get("cid")
    if not isinstance(addr, bytes) or not isinstance(cid, int) or not 0 <= cid < 1 << 62:
        raise Refused(ErrorCode.BAD_META, "UCX_CONNECT needs 'addr' (worker address bytes) and 'cid' (int)")
    try:  # a message larger than its reader's buffer is staged: at most a header, metadata or a value
        staged = P.HEADER_SIZE + max(P.MAX_META_BYTES, handler.store.config.max_value_bytes)
        stream, mine = accept(handler.stream, host, addr, cid, staged)
    except ValueError as exc:
        raise Refused(ErrorCode.BAD_META, f"UCX_CONNECT: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - reported to the client
        raise Refused(ErrorCode.INTERNAL, f"UCX endpoint to the client failed: {exc}") from None
    handler.reply(Op.UCX_CONNECT, req_id, {"addr": mine})
    # the daemon's limits and this connection's admission state carry over to the UCX side;
    # UCX_CONNECT is only served after HELLO when a token is set, so the UCX side is authenticated
    inner = Handler(stream, handler.ctx, handler.state, authed=handler.authed)
    inner.path = "ucx"
    try:
        inner.serve()
    finally:
        stream.cancel()
        try:  # ends the TCP side too: the client must not keep using a connection we left
            handler.stream.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
