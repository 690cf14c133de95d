"""Front-end bounds for the engine's aiohttp server, the same as the router's (router/http_server/).

aiohttp bounds one header line and the number of headers (answered 400), but has no bound on the
time to receive a head and none on connections. ``ConnectionGuard`` wraps aiohttp's per-connection
protocol: it follows the request stream with its own llhttp parser (``httptools``; a few
microseconds per request, next to milliseconds of model steps) and answers before aiohttp sees the
bytes:

- a head over ``max_head_bytes`` or with more than ``max_headers`` fields: 431 and a close;
- a head not complete ``head_timeout_s`` after its first byte: 408 and a close (slowloris);
- a connection past ``max_connections`` in total or ``max_connections_per_client`` from one
  address: 503 and a close, before aiohttp sees it.

Bytes the guard's parser cannot read are passed on untouched: aiohttp answers them (400).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast

import httptools
from aiohttp import web

from kvfleet.client_connections import ClientConnections

log = logging.getLogger(__name__)

# How long a refused connection's further input is read and dropped before it is closed (see router).
LINGER_S = 1.0


@dataclass(frozen=True)
class GuardSettings:
    """nginx-like defaults: 32 KiB of head, ``client_header_timeout 60s``; 100 fields as Apache."""

    max_head_bytes: int = 32 * 1024
    max_headers: int = 100
    head_timeout_s: float = 60.0
    max_connections: int = 4096
    max_connections_per_client: int = 4096


class _HeadTooLarge(Exception):
    pass


class _Guarded(asyncio.Protocol):
    """One connection: watches heads, passes everything else to aiohttp's protocol."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.remote = ""
        self.refused = False
        self.admitted = False
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._in_head = True
        self._boundary_now = False
        self._head_bytes = 0
        self._head_fields = 0
        self._head_field_bytes = 0
        self._url_bytes = 0
        self.head_started_s: float | None = None

    # -- asyncio.Protocol, delegated ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refusal = self.guard.admit(self.remote)
        if refusal is not None:
            self._refuse(503, refusal, linger=False)
            return
        self.admitted = True
        self.guard.enter(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self._parser is not None:
            status, reason = self._watch(data)
            if status:
                self._refuse(status, reason, linger=True)
                return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.refused:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.guard.leave(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- head watching -------------------------------------------------------------------------

    def _watch(self, data: bytes) -> tuple[int, str]:
        assert self._parser is not None
        settings = self.guard.settings
        now_s = asyncio.get_running_loop().time()
        self._boundary_now = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _HeadTooLarge):
                return 431, f"request head has {e.__context__}"
            self._parser = None
            return 0, ""
        except httptools.HttpParserError:  # aiohttp answers what it cannot read; stop following
            self._parser = None
            self.head_started_s = None
            return 0, ""
        if not self._in_head:
            return 0, ""
        if self.head_started_s is None:
            self.head_started_s = now_s
        # A head that began mid-read counts from the next read (as router/http_server/connection.py does).
        if not self._boundary_now:
            self._head_bytes += len(data)
            if self._head_bytes > settings.max_head_bytes:
                return 431, f"request head is larger than the limit of {settings.max_head_bytes} bytes"
        return 0, ""

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_fields = self._head_field_bytes = self._url_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self.guard.settings.max_head_bytes:
            raise _HeadTooLarge(f"a request target over the limit of {self.guard.settings.max_head_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        settings = self.guard.settings
        self._head_fields += 1
        self._head_field_bytes += len(name) + len(value) + 4
        if self._head_fields > settings.max_headers:
            raise _HeadTooLarge(f"more than {settings.max_headers} header fields")
        if self._head_field_bytes + self._url_bytes > settings.max_head_bytes:
            raise _HeadTooLarge(f"header fields over the limit of {settings.max_head_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._boundary_now = True
        self._head_bytes = 0
        self.head_started_s = None

    def on_message_complete(self) -> None:
        self._boundary_now = True

    # -- refusing ------------------------------------------------------------------------------

    def head_timed_out(self) -> None:
        self.head_started_s = None
        self._refuse(408, f"request head not complete within {self.guard.settings.head_timeout_s:g} s", linger=True)

    def _refuse(self, status: int, reason: str, *, linger: bool) -> None:
        self.refused = True
        self.guard.refusals[status] = self.guard.refusals.get(status, 0) + 1
        log.info("refused a request from %s: %d %s", self.remote or "-", status, reason)
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body = json.dumps({"error": {"message": reason, "type": "invalid_request_error", "code": status}}).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        transport.write(head + body)
        if not linger or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # lingering close: FIN now, drop further input, close later (no RST)
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)


class ConnectionGuard:
    """Wraps a protocol factory (aiohttp's ``web.Server``); one per listening server."""

    def __init__(self, settings: GuardSettings, factory: Callable[[], asyncio.Protocol]) -> None:
        self.settings = settings
        self.factory = factory
        self.connections: set[_Guarded] = set()
        self.clients = ClientConnections(settings.max_connections, settings.max_connections_per_client)
        self.refusals: dict[int, int] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self, self.factory())

    def admit(self, remote: str) -> str | None:
        return self.clients.refusal(remote, len(self.connections))

    def enter(self, conn: _Guarded) -> None:
        self.connections.add(conn)
        self.clients.opened(conn.remote)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.settings.head_timeout_s / 2, self._sweep)

    def leave(self, conn: _Guarded) -> None:
        self.connections.discard(conn)
        self.clients.closed(conn.remote)

    def _sweep(self) -> None:
        """One timer for all connections: a slow head is cut off within 1.5x the head timeout."""
        loop = asyncio.get_running_loop()
        cutoff_s = loop.time() - self.settings.head_timeout_s
        for conn in list(self.connections):
            if conn.head_started_s is not None and conn.head_started_s < cutoff_s:
                conn.head_timed_out()
        self._sweeper = loop.call_later(self.settings.head_timeout_s / 2, self._sweep) if self.connections else None

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


class GuardedTCPSite(web.BaseSite):
    """aiohttp's ``TCPSite`` with every connection passed through a ``ConnectionGuard``."""

    __slots__ = ("_bound_port", "_host", "_port", "guard")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, settings: GuardSettings) -> None:
        super().__init__(runner, backlog=1024)
        self._host = host
        self._port = port
        self._bound_port = port
        server = runner.server
        assert server is not None  # BaseSite checked it
        self.guard = ConnectionGuard(settings, cast(Callable[[], asyncio.Protocol], server))

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._bound_port}"

    @property
    def port(self) -> int:
        return self._bound_port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.guard, self._host, self._port, backlog=self._backlog)
        if self._server.sockets:
            self._bound_port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.guard.close()
        await super().stop()
