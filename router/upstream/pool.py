"""``UpstreamPool``: bounded keep-alive connections per replica origin, and the read-timeout sweep.

Which connection a request goes on (the most recently used idle one, else a new one up to
``max_connections_per_origin``, else a bounded wait for one to come free), writing the request in
one call, closing connections idle past the keep-alive timeout, and one timer that fails the reads
that passed their deadline (not a timer per request: each is CPU on the request path).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvfleet.router.upstream.connection import Origin, OriginPool, ReplicaConnection
from kvfleet.router.upstream.errors import (
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamConnectTimeoutError,
    UpstreamPoolTimeoutError,
)
from kvfleet.router.upstream.response import UpstreamResponse


@dataclass(frozen=True)
class PoolSettings:
    max_connections_per_origin: int
    keepalive_timeout_s: float
    connect_timeout_s: float
    read_timeout_s: float
    # A request waits this long for a connection when all max_connections_per_origin are in use. The
    # router passes RouterSettings.pool_wait_timeout_s; the default is for other users of the pool.
    pool_wait_timeout_s: float = 5.0


class UpstreamPool:
    """Keep-alive connections per replica origin (scheme, host, port), at most ``max_connections_per_origin``
    each; a request beyond that waits for a connection to come free, at most ``pool_wait_timeout_s``."""

    def __init__(self, settings: PoolSettings) -> None:
        self._settings = settings
        self._pools: dict[str, OriginPool] = {}
        self._ssl: ssl.SSLContext | None = None
        # Responses waiting on a replica, checked against their deadlines by one sweep (not a timer each).
        self.waiting: set[UpstreamResponse] = set()
        self._deadline_sweep: asyncio.TimerHandle | None = None
        self._sweep_interval_s = min(1.0, max(0.01, settings.read_timeout_s / 10))

    async def send(self, base_url: str, path_qs: str, headers: bytes, body: bytes) -> UpstreamResponse:
        """Write ``POST base_url+path_qs`` with pre-rendered header lines; returns without waiting for the
        answer (read ``head_done`` / ``progress``); it suspends only to wait for or open a connection.

        ``headers`` holds ``Name: value\\r\\n`` lines without Host, Content-Length or Connection.
        """
        pool = self._pools.get(base_url) or self._origin_pool(base_url)
        return self._send_on(await self._acquire(pool), path_qs, headers, body)  # an idle connection first

    def send_nowait(self, base_url: str, path_qs: str, headers: bytes, body: bytes) -> UpstreamResponse | None:
        """``send`` on an idle pooled connection, without a coroutine; None when none is idle."""
        pool = self._pools.get(base_url) or self._origin_pool(base_url)
        conn = self._idle_connection(pool)
        return self._send_on(conn, path_qs, headers, body) if conn is not None else None

    def _send_on(self, conn: ReplicaConnection, path_qs: str, headers: bytes, body: bytes) -> UpstreamResponse:
        pool = conn.owner
        request = b"".join(
            (
                b"POST ",
                path_qs.encode("latin-1"),
                b" HTTP/1.1\r\nHost: ",
                pool.origin.host_header,
                b"\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n",
                headers,
                b"\r\n",
                body,
            )
        )
        response = UpstreamResponse(self, conn, self._settings.read_timeout_s)
        conn.start(request, response)
        return response

    def watch(self, response: UpstreamResponse) -> None:
        """Check ``response``'s wait against its deadline in the next sweeps (called by the response)."""
        self.waiting.add(response)
        if self._deadline_sweep is None:
            loop = asyncio.get_running_loop()
            self._deadline_sweep = loop.call_later(self._sweep_interval_s, self._expire_waiting)

    def _expire_waiting(self) -> None:
        """Fail the waits that passed their deadline: the read timeout fires up to one interval late."""
        self._deadline_sweep = None
        loop = asyncio.get_running_loop()
        now_s = loop.time()
        for response in [r for r in self.waiting if r.deadline_s <= now_s]:
            self.waiting.discard(response)
            response.expire()
        if self.waiting:
            self._deadline_sweep = loop.call_later(self._sweep_interval_s, self._expire_waiting)

    def _origin_pool(self, base_url: str) -> OriginPool:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"replica url must be http(s)://host:port, got {base_url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        host_header = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        pool = OriginPool(base_url, Origin(parts.scheme, host, port, host_header.encode("idna")))
        self._pools[base_url] = pool
        return pool

    def _idle_connection(self, pool: OriginPool) -> ReplicaConnection | None:
        """The most recently used reusable idle connection; stale ones found on the way are closed."""
        if not pool.idle:
            return None
        now_s = asyncio.get_running_loop().time()
        while pool.idle:
            conn = pool.idle.pop()
            if conn.reusable() and now_s - conn.idle_since_s < self._settings.keepalive_timeout_s:
                return conn
            pool.open -= 1
            conn.close()
        return None

    async def _acquire(self, pool: OriginPool) -> ReplicaConnection:
        loop = asyncio.get_running_loop()
        deadline_s: float | None = None  # one bound for the whole wait, however many wake-ups lose the race
        while True:
            conn = self._idle_connection(pool)
            if conn is not None:
                return conn
            if pool.open < self._settings.max_connections_per_origin:
                pool.open += 1
                try:
                    return await self._connect(pool)
                except BaseException:
                    pool.open -= 1
                    self._wake_one(pool)
                    raise
            if deadline_s is None:
                deadline_s = loop.time() + self._settings.pool_wait_timeout_s
            waiter = loop.create_future()
            pool.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline_s):
                    await waiter
            except TimeoutError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one(pool)  # a connection came free as the wait ran out: pass it on
                origin = pool.origin
                raise UpstreamPoolTimeoutError(
                    f"all {self._settings.max_connections_per_origin} connections to {origin.host}:{origin.port} "
                    f"stayed in use for {self._settings.pool_wait_timeout_s:g} s"
                ) from None
            finally:
                if waiter in pool.waiters:
                    pool.waiters.remove(waiter)

    async def _connect(self, pool: OriginPool) -> ReplicaConnection:
        loop = asyncio.get_running_loop()
        origin = pool.origin
        ssl_context: ssl.SSLContext | None = None
        if origin.scheme == "https":
            ssl_context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: ReplicaConnection(pool), origin.host, origin.port, ssl=ssl_context
                )
        except TimeoutError:
            raise UpstreamConnectTimeoutError(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as e:
            raise UpstreamConnectError(f"connect to {origin.host}:{origin.port} failed: {e}") from e
        return conn

    def put_back(self, conn: ReplicaConnection) -> None:
        """A connection whose response was read whole: idle again, for the next request (called by the response)."""
        pool = conn.owner
        if pool.closed:
            conn.close()
            return
        loop = asyncio.get_running_loop()
        conn.idle_since_s = loop.time()
        pool.idle.append(conn)
        if pool.sweep is None:
            pool.sweep = loop.call_later(self._settings.keepalive_timeout_s, self._sweep, pool)
        self._wake_one(pool)

    def _sweep(self, pool: OriginPool) -> None:
        """Close connections idle for longer than the keep-alive timeout; again later while any stay idle."""
        pool.sweep = None
        loop = asyncio.get_running_loop()
        cutoff_s = loop.time() - self._settings.keepalive_timeout_s
        expired = [c for c in pool.idle if c.idle_since_s <= cutoff_s]
        for conn in expired:
            pool.idle.remove(conn)
            pool.open -= 1
            conn.close()
        if pool.idle and not pool.closed:
            pool.sweep = loop.call_later(self._settings.keepalive_timeout_s, self._sweep, pool)
        elif not pool.open and not pool.waiters:
            self._pools.pop(pool.key, None)  # a replica that is gone leaves nothing behind

    def discard(self, conn: ReplicaConnection) -> None:
        """A connection that will not serve again: closed, its slot given to a waiter (called by the response)."""
        conn.close()
        pool = conn.owner
        pool.open -= 1
        self._wake_one(pool)

    @staticmethod
    def _wake_one(pool: OriginPool) -> None:
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        if self._deadline_sweep is not None:
            self._deadline_sweep.cancel()
            self._deadline_sweep = None
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.closed = True
            if pool.sweep is not None:
                pool.sweep.cancel()
            for conn in pool.idle:
                conn.close()
            pool.idle.clear()
            for waiter in pool.waiters:
                if not waiter.done():
                    waiter.set_exception(UpstreamClosedError("the router is shutting down"))
