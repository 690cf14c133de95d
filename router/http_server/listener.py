"""``HttpServer``: listens, admits or refuses each connection, sweeps idle ones, stops gracefully.

The whole-server state (the open connections, the count per client address, the refusal counts the
metrics read) lives here; each connection's parsing and serving is ``connection.ClientConnection``.
"""

from __future__ import annotations

import asyncio

from kvfleet.client_connections import ClientConnections
from kvfleet.router.http_server.bounds import HttpServerSettings
from kvfleet.router.http_server.connection import ClientConnection
from kvfleet.router.http_server.messages import Handler


class _ConnectionSet(set[ClientConnection]):
    """The open connections; ``discard_if_present`` says whether one was counted (refused ones never are)."""

    def discard_if_present(self, conn: ClientConnection) -> bool:
        if conn in self:
            self.remove(conn)
            return True
        return False


class HttpServer:
    """Listens and serves ``handler``; ``port`` is the bound one after ``start``."""

    def __init__(self, handler: Handler, settings: HttpServerSettings) -> None:
        self.handler = handler
        self.settings = settings
        self.connections = _ConnectionSet()
        self.clients = ClientConnections(settings.max_connections, settings.max_connections_per_client)
        # Requests and connections refused before reaching the handler, by HTTP status (for metrics).
        self.refusals: dict[int, int] = {}
        self.closing = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop  # set by start; connections exist only after it

    async def start(self, host: str, port: int) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: ClientConnection(self), host, port, reuse_address=True, backlog=1024
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._schedule_sweep()

    def admit(self, remote: str) -> str | None:
        """Why a new connection from ``remote`` is refused, or None to accept it."""
        return self.clients.refusal(remote, len(self.connections))

    def _schedule_sweep(self) -> None:
        # One timer for all connections (not one per request): idle ones are closed within 1.5x the
        # keep-alive timeout, and heads that take too long within 1.5x the head timeout.
        interval_s = min(self.settings.keepalive_timeout_s, self.settings.head_timeout_s) / 2
        self._sweeper = self.loop.call_later(interval_s, self._sweep)

    def _sweep(self) -> None:
        now_s = self.loop.time()
        cutoff_s = now_s - self.settings.keepalive_timeout_s
        head_cutoff_s = now_s - self.settings.head_timeout_s
        for conn in list(self.connections):
            if conn.head_started_s is not None and conn.head_started_s < head_cutoff_s:
                conn.head_timed_out(self.settings.head_timeout_s)
            elif conn.last_activity_s < cutoff_s:
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
