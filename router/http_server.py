"""The router's HTTP/1.1 server: asyncio protocols with ``httptools`` (llhttp) parsing requests.

Hand-written instead of aiohttp's server for CPU per request: the router spent ~70 us of its ~130 us
per proxied request in aiohttp's request, response and writer objects (measured with py-spy under
wrk; see docs/benchmarks/router.md), and a request through this server costs ~10 us. It does what a
proxy's front end needs and no more:

- keep-alive, HTTP/1.0 and 1.1, pipelined requests answered in order (reading pauses past a bound);
- request bodies (``Content-Length`` or chunked) up to ``max_body_bytes``; a larger one is read and
  dropped (up to a bound, then the connection is closed) and answered by the handler's 413;
  ``Expect: 100-continue`` is answered;
- whole responses in one write, or streamed ones (chunked framing) with flow control;
- a client that goes away cancels its handler, so the upstream request is cancelled too;
- idle connections closed after ``keepalive_timeout_s``; a malformed request gets 400 and a close;
- ``close`` stops listening, lets in-flight requests finish for a grace period, then cancels them.

The application is one ``Handler``: ``async (HttpRequest, Responder) -> None``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast

import httptools

from kvfleet.openai_shape import error_body

log = logging.getLogger(__name__)

# Complete requests queued on one connection before reading from it pauses (pipelining bound).
MAX_PIPELINED = 16
# Bytes of an over-limit body read and dropped before the connection is closed instead.
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class HttpServerSettings:
    max_body_bytes: int
    keepalive_timeout_s: float
    shutdown_timeout_s: float


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

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path


Headers = Iterable[tuple[str, str]]
Handler = Callable[[HttpRequest, "Responder"], Awaitable[None]]


class Responder:
    """Writes one response: ``send`` (whole) or ``start`` + ``write``... + ``end`` (streamed)."""

    __slots__ = ("_chunked", "_conn", "_keep_alive", "_version", "finished", "started")

    def __init__(self, conn: _Connection, request: HttpRequest) -> None:
        self._conn = conn
        self._version = "1.1" if request.http_version == "1.1" else "1.0"
        self._keep_alive = request.keep_alive
        self._chunked = False
        self.started = False
        self.finished = False

    def _head(self, status: int, reason: str | None, headers: Headers, framing: bytes, raw: bytes) -> bytes:
        keep_alive = self._keep_alive and not self._conn.server.closing
        self._keep_alive = keep_alive
        phrase = reason or _reason(status)
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


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and runs the handler for each, one at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_activity_s = 0.0
        self._parser = httptools.HttpRequestParser(self)
        self._remote = ""
        self._pending: deque[HttpRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._read_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._too_large = False
        self._keep_alive = True

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        self.last_activity_s = self.server.loop.time()
        peer = transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to disable
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_activity_s = self.server.loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(501, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._pending.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client is gone: stop its request (and the upstream one with it)
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._body_bytes = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()  # asked now: llhttp forgets it after the message
        length = None
        expect = False
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length" and value.isdigit():
                length = int(value)
            elif lower == b"expect" and value.lower() == b"100-continue":
                expect = True
        if length is not None and length > self.server.settings.max_body_bytes:
            self._too_large = True
            if length > DISCARD_LIMIT_BYTES:  # not worth reading to answer politely
                self._refuse(413, "request body is larger than the router's limit")
                return
        if expect and not self._too_large and self._parser.get_http_version() == "1.1":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._too_large or self._body_bytes > self.server.settings.max_body_bytes:
            self._too_large = True
            self._body = []
            if self._body_bytes > DISCARD_LIMIT_BYTES:
                self._refuse(413, "request body is larger than the router's limit")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._parser.should_upgrade():
            return  # HttpParserUpgrade follows: refused in data_received
        url = httptools.parse_url(self._url) if self._url else None
        path = url.path.decode("latin-1") if url is not None and url.path else "/"
        query = url.query.decode("latin-1") if url is not None and url.query else ""
        body = b"" if self._too_large else (self._body[0] if len(self._body) == 1 else b"".join(self._body))
        request = HttpRequest(
            self._parser.get_method().decode("latin-1"),
            path,
            query,
            self._headers,
            body,
            self._too_large,
            self._parser.get_http_version(),
            self._keep_alive,
            self._remote,
        )
        self._headers = []
        self._body = []
        self._pending.append(request)
        if len(self._pending) >= MAX_PIPELINED and not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()
        if self._task is None:
            self._task = self.server.loop.create_task(self._serve())

    # -- serving ---------------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while self._pending and not self.closed:
                request = self._pending.popleft()
                if self._read_paused and len(self._pending) < MAX_PIPELINED // 2 and self.transport is not None:
                    self._read_paused = False
                    self.transport.resume_reading()
                responder = Responder(self, request)
                try:
                    await self.server.handler(request, responder)
                except (ConnectionError, _ClientGone):
                    return
                except Exception:
                    log.exception("unhandled error serving %s %s", request.method, request.path)
                    if responder.started:
                        responder.abort()
                        return
                    responder.send(
                        500, [("Content-Type", "application/json")], b'{"error": {"message": "internal error"}}'
                    )
                if not responder.finished:
                    if responder.started:
                        responder.abort()
                        return
                    responder.send(500, [("Content-Type", "text/plain")], b"no response")
                self.last_activity_s = self.server.loop.time()
        finally:
            self._task = None

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise _ClientGone()
        self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise _ClientGone()
        if not self._write_paused:
            return
        waiter = self.server.loop.create_future()
        self._drain_waiter = waiter
        try:
            await waiter
        finally:
            self._drain_waiter = None
        if self.closed:
            raise _ClientGone()

    def _wake_writer(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def response_done(self, keep_alive: bool) -> None:
        if not keep_alive and self.transport is not None:
            self._pending.clear()
            self.transport.close()  # after the buffered response is flushed

    def abort(self) -> None:
        self._pending.clear()
        if self.transport is not None:
            self.transport.abort()

    def idle(self) -> bool:
        return self._task is None and not self._pending

    def close_if_idle(self) -> None:
        if self.idle() and self.transport is not None:
            self.transport.close()

    def _refuse(self, status: int, reason: str) -> None:
        """Answer a request that cannot be parsed or read, then close (the stream cannot be trusted)."""
        self._pending.clear()
        if self.transport is None or self.transport.is_closing():
            return
        body = json.dumps(error_body(reason, "invalid_request_error")).encode()
        head = (
            f"HTTP/1.1 {status} {_reason(status)}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        if self._task is None:  # never interleave with a response being written
            self.transport.write(head + body)
        self.transport.close()
        self.closed = True


class _ClientGone(Exception):
    """The client connection closed while its response was being written."""


class HttpServer:
    """Listens and serves ``handler``; ``port`` is the bound one after ``start``."""

    def __init__(self, handler: Handler, settings: HttpServerSettings) -> None:
        self.handler = handler
        self.settings = settings
        self.connections: set[_Connection] = set()
        self.closing = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop  # set by start; connections exist only after it

    async def start(self, host: str, port: int) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=1024
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._schedule_sweep()

    def _schedule_sweep(self) -> None:
        # One timer for all connections (not one per request): idle ones are closed within 1.5x the timeout.
        self._sweeper = self.loop.call_later(self.settings.keepalive_timeout_s / 2, self._sweep)

    def _sweep(self) -> None:
        cutoff_s = self.loop.time() - self.settings.keepalive_timeout_s
        for conn in list(self.connections):
            if conn.last_activity_s < cutoff_s:
                conn.close_if_idle()
        if not self.closing:
            self._schedule_sweep()

    async def close(self) -> None:
        """Stop listening; in-flight requests get ``shutdown_timeout_s`` to finish, then are cancelled."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        deadline_s = self.loop.time() + self.settings.shutdown_timeout_s
        while True:
            for conn in list(self.connections):
                conn.close_if_idle()
            busy = [c for c in self.connections if not c.idle()]
            if not busy or self.loop.time() >= deadline_s:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
