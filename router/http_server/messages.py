"""What a handler sees: the parsed ``HttpRequest`` and the ``Responder`` that writes its answer.

Apart from the connection protocol because this is the application's side of the server (proxy.py,
forward.py and headers.py use these names) and the protocol is the socket's side.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet.router.http_server.connection import ClientConnection


class HttpRequest:
    """One parsed request. ``body_too_large`` is set (and ``body`` empty) when it was over the limit."""

    __slots__ = (
        "body",
        "body_too_large",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_headers",
        "remote",
        "target",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes,
        body_too_large: bool,
        http_version: str,
        keep_alive: bool,
        remote: str,
        target: str = "",
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.raw_headers = raw_headers
        self.body = body
        self.body_too_large = body_too_large
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.remote = remote
        self.target = target  # as sent

    @property
    def path_qs(self) -> str:
        """The origin-form target to forward: as sent when it is one (an empty query kept), else rebuilt."""
        if self.target.startswith("/"):
            return self.target
        return f"{self.path}?{self.query}" if self.query else self.path


Headers = Iterable[tuple[str, str]]
Handler = Callable[[HttpRequest, "Responder"], Awaitable[None]]


class Responder:
    """Writes one response: ``send`` (whole) or ``start`` + ``write``... + ``end`` (streamed)."""

    __slots__ = ("_chunked", "_conn", "_keep_alive", "_version", "finished", "started")

    def __init__(self, conn: ClientConnection, request: HttpRequest) -> None:
        self._conn = conn
        self._version = "1.1" if request.http_version == "1.1" else "1.0"
        self._keep_alive = request.keep_alive
        self._chunked = False
        self.started = False
        self.finished = False

    def _head(self, status: int, reason: str | None, headers: Headers, framing: bytes, raw: bytes) -> bytes:
        keep_alive = self._keep_alive and not self._conn.server.closing
        self._keep_alive = keep_alive
        phrase = reason or reason_phrase(status)
        lines = [f"HTTP/{self._version} {status} {phrase}\r\n".encode("latin-1")]
        lines.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers)
        lines.append(raw)
        lines.append(framing)
        if not keep_alive:
            lines.append(b"Connection: close\r\n")
        elif self._version == "1.0":
            lines.append(b"Connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def send(
        self, status: int, headers: Headers, body: bytes, *, reason: str | None = None, raw_headers: bytes = b""
    ) -> None:
        """The whole response, in one write. ``raw_headers``: more header lines, already ``Name: value\\r\\n``."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        head = self._head(status, reason, headers, b"Content-Length: %d\r\n" % len(body), raw_headers)
        self._conn.write(head + body)
        self._conn.response_done(self._keep_alive)

    def start(
        self,
        status: int,
        headers: Headers,
        *,
        content_length: int | None = None,
        reason: str | None = None,
        raw_headers: bytes = b"",
    ) -> None:
        """The status line and headers; the body follows with ``write`` (chunked unless its length is known)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        if content_length is not None:
            framing = b"Content-Length: %d\r\n" % content_length
        elif self._version == "1.1":
            self._chunked = True
            framing = b"Transfer-Encoding: chunked\r\n"
        else:  # an HTTP/1.0 client: the body ends when the connection does
            self._keep_alive = False
            framing = b""
        self._conn.write(self._head(status, reason, headers, framing, raw_headers))

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._conn.write(data)
        await self._conn.drain()

    def end(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self._conn.response_done(self._keep_alive)

    def abort(self) -> None:
        """Drop the connection: the client sees a truncated transfer, not a short body that looks complete."""
        self.finished = True
        self._conn.abort()


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
