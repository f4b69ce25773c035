"""One data-plane connection: read frames, run them against the store, answer in order.

Requests on a connection are handled one after another, so a client may pipeline them. A
request the daemon refuses (bad metadata, unknown opcode) is answered with an ERROR reply and
its payload is drained, keeping the connection usable. A frame that cannot be trusted (bad
magic, wrong version, oversized lengths) is answered and the connection is closed. Either way
only this connection is affected.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from gcache import protocol as P
from gcache.protocol import ErrorCode, Op, Status
from gcache.tier.store import Hit, Store
from gcache.wire import DRAIN_CHUNK, drain, recv_exact, send_all

log = logging.getLogger(__name__)


class Refused(Exception):
    """Refuse the whole request with an ERROR reply; ``fatal`` also closes the connection."""

    def __init__(self, code: ErrorCode, msg: str, fatal: bool = False) -> None:
        super().__init__(msg)
        self.code, self.msg, self.fatal = code, msg, fatal


class Handler:
    def __init__(self, sock: socket.socket, store: Store, node_id: str, max_payload: int) -> None:
        self.sock = sock
        self.store = store
        self.node_id = node_id
        self.max_payload = max_payload
        self._hdr = memoryview(bytearray(P.HEADER_SIZE))
        self._scratch = memoryview(bytearray(DRAIN_CHUNK))

    def serve(self) -> None:
        """Serve until the peer closes or sends a frame that cannot be trusted."""
        while True:
            try:
                n = self.sock.recv_into(self._hdr)
            except OSError:
                return
            if n == 0:
                return
            if n < P.HEADER_SIZE:
                recv_exact(self.sock, self._hdr[n:])
            if not self._one_request():
                return

    def _one_request(self) -> bool:
        req_id = 0
        payload_len = 0
        consumed = 0
        try:
            try:
                version, op, _flags, req_id, meta_len, payload_len = P.unpack_header(self._hdr)
            except ValueError as exc:
                raise Refused(ErrorCode.BAD_FRAME, str(exc), fatal=True) from None
            if version != P.VERSION:
                raise Refused(ErrorCode.BAD_VERSION, f"protocol version {version} not supported (speak {P.VERSION})", True)
            if payload_len > self.max_payload:
                raise Refused(ErrorCode.TOO_LARGE, f"payload of {payload_len} bytes exceeds {self.max_payload}", True)
            raw = bytearray(meta_len)
            recv_exact(self.sock, memoryview(raw))
            try:
                meta = P.decode_meta(raw)
            except ValueError as exc:
                raise Refused(ErrorCode.BAD_META, str(exc)) from None
            try:
                op = Op(op)
            except ValueError:
                raise Refused(ErrorCode.UNKNOWN_OP, f"unknown opcode {op}") from None
            if op is Op.PUT:
                reply, consumed = self._put(meta, payload_len)
                self._reply(op, req_id, reply)
                return True
            if payload_len:
                raise Refused(ErrorCode.BAD_META, f"{op.name} carries no payload, got {payload_len} bytes")
            if op is Op.GET:
                self._get(req_id, meta)
                return True
            self._reply(op, req_id, self._simple(op, meta))
            return True
        except Refused as r:
            log.warning("refused request %d from %s: %s", req_id, self._peer(), r.msg)
            try:
                if not r.fatal:
                    drain(self.sock, payload_len - consumed, self._scratch)
                self._reply(0, req_id, {"code": int(r.code), "msg": r.msg}, P.FLAG_ERROR)
            except OSError:
                return False
            return not r.fatal
        except OSError:
            return False
        except Exception as exc:  # a bug: answer, then drop this connection only
            log.exception("internal error on request %d from %s", req_id, self._peer())
            try:
                self._reply(0, req_id, {"code": int(ErrorCode.INTERNAL), "msg": f"internal error: {exc}"}, P.FLAG_ERROR)
            except OSError:
                pass
            return False

    # -- ops --------------------------------------------------------------------------------
    def _put(self, meta: dict[str, Any], payload_len: int) -> tuple[dict, int]:
        ns, keys = self._ns_keys(meta)
        sizes = meta.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != len(keys):
            raise Refused(ErrorCode.BAD_META, "PUT needs 'sizes': one non-negative int per key")
        if any(not isinstance(s, int) or s < 0 for s in sizes) or sum(sizes) != payload_len:
            raise Refused(ErrorCode.BAD_META, f"PUT sizes must be ints >= 0 summing to the payload ({payload_len})")
        ttl = meta.get("ttl", 0)
        if not isinstance(ttl, (int, float)) or ttl < 0:
            raise Refused(ErrorCode.BAD_META, "PUT 'ttl' must be a number of seconds >= 0")
        status: list[int] = []
        consumed = 0
        for key, size in zip(keys, sizes):
            st = Status.BAD_KEY if P.key_error(key) else None
            res = self.store.reserve(size) if st is None else st
            if isinstance(res, Status):
                drain(self.sock, size, self._scratch)
                status.append(int(res))
            else:
                try:
                    recv_exact(self.sock, res.view)
                except BaseException:
                    self.store.abort(res)
                    raise
                self.store.commit((ns, key), res, ttl)
                status.append(int(Status.OK))
            consumed += size
        return {"st": status}, consumed

    def _get(self, req_id: int, meta: dict[str, Any]) -> None:
        ns, keys = self._ns_keys(meta)
        hits: list[Hit] = []
        status: list[int] = []
        sizes: list[int] = []
        try:
            for key in keys:
                hit = None if P.key_error(key) else self.store.acquire((ns, key))
                if hit is None:
                    status.append(int(Status.BAD_KEY if P.key_error(key) else Status.NOT_FOUND))
                    sizes.append(0)
                else:
                    hits.append(hit)
                    status.append(int(Status.OK))
                    sizes.append(len(hit.view))
            self._reply(Op.GET, req_id, {"st": status, "sz": sizes}, 0, [h.view for h in hits])
        finally:
            for hit in hits:
                self.store.release(hit)

    def _simple(self, op: Op, meta: dict[str, Any]) -> dict[str, Any]:
        if op is Op.PING:
            return {"node": self.node_id, "v": P.VERSION}
        if op is Op.STATS:
            return {"node": self.node_id, "stats": self.store.stats()}
        ns, keys = self._ns_keys(meta)
        fn = self.store.exists if op is Op.EXISTS else self.store.delete
        return {
            "st": [
                int(Status.BAD_KEY if P.key_error(k) else (Status.OK if fn((ns, k)) else Status.NOT_FOUND))
                for k in keys
            ]
        }

    @staticmethod
    def _ns_keys(meta: dict[str, Any]) -> tuple[str, list]:
        ns, keys = meta.get("ns"), meta.get("keys")
        err = P.namespace_error(ns)
        if err:
            raise Refused(ErrorCode.BAD_META, err)
        if not isinstance(keys, list) or len(keys) > P.MAX_BATCH_KEYS:
            raise Refused(ErrorCode.BAD_META, f"'keys' must be a list of at most {P.MAX_BATCH_KEYS} byte strings")
        return ns, keys  # type: ignore[return-value]

    # -- replies ----------------------------------------------------------------------------
    def _reply(self, op: int, req_id: int, meta: dict, flags: int = 0, payload: list | None = None) -> None:
        raw = P.encode_meta(meta)
        payload = payload or []
        total = sum(len(v) for v in payload)
        head = P.pack_header(op, P.FLAG_REPLY | flags, req_id, len(raw), total)
        send_all(self.sock, [head + raw, *payload])

    def _peer(self) -> str:
        try:
            host, port = self.sock.getpeername()[:2]
            return f"{host}:{port}"
        except OSError:
            return "?"
