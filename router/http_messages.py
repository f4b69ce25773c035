"""HTTP messages of the router's server (``router.http11``): a parsed ``Request``, a whole
``Response``, JSON answers, response heads, and the server's limits. Pure."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import parse_qsl

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class Response:
    """A whole answer: status, body, content type and extra headers."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", content_type: str = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers or {}

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == name), None)


def json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(obj).encode(), "application/json", headers)


def json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status, headers)


class Request:
    """One parsed request: method, path, raw query, headers as sent (bytes), whole body.
    ``reject`` is set when the server itself refuses it (status, message); the connection
    closes after the answer."""

    __slots__ = ("body", "content_length", "headers", "keep_alive", "method", "path", "query_string",
                 "reject", "version")

    def __init__(self, method: str, path: str, query_string: str, headers: list[tuple[bytes, bytes]],
                 body: bytes, version: str, keep_alive: bool, content_length: int | None) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.version = version
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.reject: tuple[int, str] | None = None

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        for k, v in self.headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.query_string))

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query_string}" if self.query_string else self.path

    def json(self) -> object:
        return json.loads(self.body)


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 << 20
    max_head_bytes: int = 64 << 10
    request_timeout_s: float = 30.0  # a request's head and body, from its first byte
    keepalive_s: float = 75.0

    @property
    def sweep_s(self) -> float:
        return max(0.02, min(1.0, self.request_timeout_s / 4))


_date_cache: list = [0, b""]


def _date() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0], _date_cache[1] = now, formatdate(now, usegmt=True).encode()
    return _date_cache[1]


def head_bytes(status: int, headers: list[bytes], keep_alive: bool, reason: bytes | None = None) -> bytes:
    """A response head; ``headers`` are complete ``Name: value\\r\\n`` lines."""
    return b"".join((b"HTTP/1.1 %d %s\r\nDate: " % (status, reason or _REASONS.get(status, b"Unknown")), _date(),
                     b"\r\n", *headers, b"" if keep_alive else b"Connection: close\r\n", b"\r\n"))
