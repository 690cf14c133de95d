"""One client connection: llhttp's callbacks, the head and body bounds, and serving in order.

The parser feeds ``HttpRequest`` objects into a queue that one task serves, one request at a time,
so pipelined requests are answered in order; anything the server refuses before the handler (an
over-limit head, a bad transfer coding, a head that takes too long) is answered here, then the
connection closes, with a lingering close so the answer is not lost to a TCP reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools

from kvfleet.openai_shape import error_body
from kvfleet.router.http_server.bounds import DISCARD_LIMIT_BYTES, LINGER_S, MAX_PIPELINED
from kvfleet.router.http_server.messages import HttpRequest, Responder, reason_phrase

if TYPE_CHECKING:
    from kvfleet.router.http_server.listener import HttpServer

# The server's logger, whichever module of it writes the record.
log = logging.getLogger("kvfleet.router.http_server")


class ClientConnection(asyncio.Protocol):
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
        # Head bounds: bytes and fields of the head being received, and when its first byte came.
        self._in_head = True
        self._boundary_now = False
        self._head_bytes = 0
        self._head_count = 0
        self._head_field_bytes = 0
        self._after_head_bytes = 0
        self.head_started_s: float | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        self.last_activity_s = self.server.loop.time()
        peer = transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refusal = self.server.admit(self._remote)
        if refusal is not None:
            self._refuse(503, refusal)
            return
        self.server.connections.add(self)
        self.server.clients.opened(self._remote)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to disable
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        now_s = self.last_activity_s = self.server.loop.time()
        self._boundary_now = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(501, "protocol upgrades are not supported")
            return
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _HeadTooLarge):
                self._refuse(431, f"request head has {cause}")
            elif isinstance(cause, _Refusal):
                self._refuse(cause.status, str(cause))
            else:
                self._refuse(400, f"malformed HTTP request: {e}")
            return
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")
            return
        if self.closed:
            return
        if not self._in_head:
            # Body, chunk framing and trailers: llhttp buffers a trailer field whole, so the bytes
            # after the head are bounded as a dropped over-limit body is.
            self._after_head_bytes += len(data)
            if self._after_head_bytes > DISCARD_LIMIT_BYTES:
                self._refuse(413, "request body is larger than the router's limit")
            return
        if self.head_started_s is None:
            self.head_started_s = now_s
        # Still inside a head. Its bytes are all of this read unless a message part ended in it (then the
        # head began inside it, at an offset llhttp does not report: counted from the next read on, so a
        # head can overshoot the bound by at most one read, 256 KiB).
        if not self._boundary_now:
            self._head_bytes += len(data)
            if self._head_bytes > self.server.settings.max_head_bytes:
                limit = self.server.settings.max_head_bytes
                self._refuse(431, f"request head is larger than the limit of {limit} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.server.connections.discard_if_present(self):
            self.server.clients.closed(self._remote)
        self.closed = True
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
        self._in_head = True
        self._head_count = 0
        self._head_field_bytes = 0
        self._url = b""
        self._headers = []
        self._body = []
        self._body_bytes = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.server.settings.max_head_bytes:
            raise _HeadTooLarge(f"a request target over the limit of {self.server.settings.max_head_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            # A chunked body's trailer field: dropped, never merged into the headers forwarded (a client
            # could otherwise slip in a header past whatever checked the head). Still counted and bounded.
            self._head_count += 1
            if self._head_count > self.server.settings.max_headers:
                raise _HeadTooLarge(f"more than {self.server.settings.max_headers} header and trailer fields")
            return
        # Checked here too, not only per read: a whole head can arrive in one read.
        self._head_count += 1
        self._head_field_bytes += len(name) + len(value) + 4
        settings = self.server.settings
        if self._head_count > settings.max_headers:
            # Raised through llhttp so it stops parsing; data_received answers it.
            raise _HeadTooLarge(f"more than {settings.max_headers} header fields")
        if self._head_field_bytes + len(self._url) > settings.max_head_bytes:
            raise _HeadTooLarge(f"header fields over the limit of {settings.max_head_bytes} bytes")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._boundary_now = True
        self._head_bytes = 0
        self._after_head_bytes = 0
        self.head_started_s = None
        self._keep_alive = self._parser.should_keep_alive()  # asked now: llhttp forgets it after the message
        length = None
        expect = False
        hosts = 0
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length" and value.isdigit():
                length = int(value)
            elif lower == b"expect" and value.lower() == b"100-continue":
                expect = True
            elif lower == b"host":
                hosts += 1
            elif lower == b"transfer-encoding" and value.strip(b" \t").lower() != b"chunked":
                # Only chunked is decoded here; forwarding a body in another coding without saying so
                # would have the replica misread it (RFC 9112 6.1: 501).
                raise _Refusal(501, f"transfer coding {value.decode('latin-1')!r} is not supported (only chunked)")
        # RFC 9112 3.2: an HTTP/1.1 request without exactly one Host gets 400 (and h11 refuses it too).
        if hosts > 1 or (hosts == 0 and self._parser.get_http_version() == "1.1"):
            raise _Refusal(400, "an HTTP/1.1 request needs exactly one Host header")
        if b"#" in self._url:
            raise _Refusal(400, "a request target must not contain a fragment ('#')")
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
        self._boundary_now = True
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
            self._url.decode("latin-1"),
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

    def head_timed_out(self, timeout_s: float) -> None:
        self.head_started_s = None
        self._refuse(408, f"request head not complete within {timeout_s:g} s")

    def _refuse(self, status: int, reason: str) -> None:
        """Answer a request that cannot be parsed or read, then close (the stream cannot be trusted)."""
        refusals = self.server.refusals
        refusals[status] = refusals.get(status, 0) + 1
        log.info("refused a request from %s: %d %s", self._remote or "-", status, reason)
        self._pending.clear()
        if self.transport is None or self.transport.is_closing():
            return
        body = json.dumps(error_body(reason, "invalid_request_error")).encode()
        head = (
            f"HTTP/1.1 {status} {reason_phrase(status)}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        if self._task is not None:  # never interleave with a response being written
            self.transport.close()
            self.closed = True
            return
        self.transport.write(head + body)
        self.closed = True
        if status == 503 or not self.transport.can_write_eof():
            self.transport.close()
            return
        # Lingering close (as nginx does): send FIN after the answer and read and drop what the client
        # is still sending for a while. Closing with unread input sends RST, which can destroy the
        # answer before the client reads it.
        self.transport.write_eof()
        self.server.loop.call_later(LINGER_S, self.transport.close)


class _ClientGone(Exception):
    """The client connection closed while its response was being written."""


class _HeadTooLarge(Exception):
    """A request head went past a bound while llhttp was parsing it."""


class _Refusal(Exception):
    """A request head llhttp accepts but the server refuses, with the status to answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
