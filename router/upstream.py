"""The router's HTTP/1.1 client to replicas: a bounded keep-alive pool per replica origin.

Hand-written on asyncio protocols with ``httptools`` (llhttp) parsing the responses, instead of
``aiohttp.ClientSession``: a proxied request through aiohttp's client cost ~140 us of CPU (request
and payload objects, header merging, timers, tasks), over half of the router's per-request cost.
This does only what a proxy needs: one write of the request, the response head, then the body as
it arrives (chunked framing decoded), with flow control, an idle read timeout, and connections
returned to the pool only after a complete response.

Errors (all ``UpstreamIOError``), by how a request fails: ``UpstreamPoolTimeoutError`` (no pooled
connection came free within ``pool_wait_timeout_s``: nothing was sent), ``UpstreamConnectError``
(nothing was sent; ``UpstreamConnectTimeoutError`` when ``connect_timeout_s`` ran out),
``UpstreamClosedError`` (the connection broke), ``UpstreamTimeoutError`` (the replica went silent for
``read_timeout_s``). ``is_timeout`` marks the three that are a wait running out. The router maps them
to its answers in one place (``kvfleet.router.forward.upstream_failure``).

An ``UpstreamResponse`` is a context manager: leaving its block gives the connection back to the pool
when the block ended normally (``release``) and closes it when it raised (``close``).

One module over 400 lines on purpose: the connection, the response and the pool share private state
(the pool's open count and waiters, the deadline sweep's waiting set) that splitting them would make public.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

# Body bytes buffered from a replica before reading from its socket pauses (backpressure from a slow client).
HIGH_WATER_BYTES = 256 * 1024


class UpstreamIOError(Exception):
    """Talking to a replica failed."""

    is_timeout = False  # a wait ran out (as opposed to a refusal or a broken connection)


class UpstreamPoolTimeoutError(UpstreamIOError):
    """Every connection the pool may hold to the replica stayed in use for ``pool_wait_timeout_s``:
    nothing was sent."""

    is_timeout = True


class UpstreamConnectError(UpstreamIOError):
    """No connection could be made: nothing was sent."""


class UpstreamConnectTimeoutError(UpstreamConnectError):
    """The TCP (or TLS) connect took longer than ``connect_timeout_s``: nothing was sent."""

    is_timeout = True


class UpstreamClosedError(UpstreamIOError):
    """The connection closed or broke before the response was complete."""


class UpstreamTimeoutError(UpstreamIOError):
    """The replica sent nothing for longer than the read timeout."""

    is_timeout = True


@dataclass(frozen=True)
class PoolSettings:
    max_connections_per_origin: int
    keepalive_timeout_s: float
    connect_timeout_s: float
    read_timeout_s: float
    # A request waits this long for a connection when all max_connections_per_origin are in use. The
    # router passes RouterSettings.pool_wait_timeout_s; the default is for other users of the pool.
    pool_wait_timeout_s: float = 5.0


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int
    host_header: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one response at a time."""

    def __init__(self, owner: _OriginPool) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since_s = 0.0
        self._response: UpstreamResponse | None = None
        self._parser: httptools.HttpResponseParser | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes while idle: the replica broke the protocol; drop the connection
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamClosedError("replica switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(UpstreamClosedError(f"malformed response from replica: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._response is not None:
            self._response._connection_lost(exc)
        elif self in self.owner.idle:  # an idle keep-alive connection the replica closed
            self.owner.idle.remove(self)
            self.owner.open -= 1

    def pause_writing(self) -> None:  # the request is written in one call; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- used by the pool and the response ----------------------------------------------------------

    def start(self, request: bytes, response: UpstreamResponse) -> None:
        assert self.transport is not None
        self._response = response
        self._parser = httptools.HttpResponseParser(response)
        self.transport.write(request)

    def finish(self) -> None:
        self._response = None
        self._parser = None

    def reusable(self) -> bool:
        return not self.closed and self._parser is None and self.transport is not None

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()  # no lingering: the replica must see the request go away now

    def _fail(self, error: Exception) -> None:
        if self._response is not None:
            self._response._set_error(error)
        self.close()


class UpstreamResponse:
    """A replica's answer: ``status``, ``reason`` and ``raw_headers`` once the head is in, then ``readany``.

    Used as ``with response:``, it is released exactly once: on a normal exit ``release`` (a fully read
    answer's connection goes back to the pool, an unfinished one is closed), on an exception ``close``
    (the replica must see the request go away). ``release`` and ``close`` may also be called directly.
    It is also the httptools parser's callback object (the ``on_*`` methods).
    """

    def __init__(self, pool: UpstreamPool, connection: _Connection, read_timeout_s: float) -> None:
        self._pool = pool
        self._conn = connection
        self._read_timeout_s = read_timeout_s
        self._loop = asyncio.get_running_loop()
        self.status = 0
        self.reason = ""
        # As sent, in order, undecoded: a proxy passes most of them on as they are.
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_type = "application/octet-stream"
        self.content_length: int | None = None
        self._head_done = False
        self._keep_alive = False
        self._until_close = False  # no length and not chunked: the body ends when the connection does
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._eof = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.deadline_s = 0.0  # while waiting: when the idle read timeout fires (the pool's sweep checks)
        self._done = False

    def __enter__(self) -> UpstreamResponse:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            self.release()
        else:
            self.close()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason = status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._conn._parser
        assert parser is not None
        self.status = parser.get_status_code()
        chunked = False
        for name, value in self.raw_headers:
            lower = name.lower()
            if lower == b"content-type":
                media = value.partition(b";")[0].strip().lower()
                self.content_type = media.decode("latin-1") if media else self.content_type
            elif lower == b"content-length" and value.isdigit():
                self.content_length = int(value)
            elif lower == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        self._until_close = self.content_length is None and not chunked and self.status not in (204, 304)
        # Asked now: llhttp forgets the connection's keep-alive state once the message is complete.
        self._keep_alive = parser.should_keep_alive()
        self._head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def on_message_complete(self) -> None:
        self._eof = True
        self._wake()

    # -- from the connection ---------------------------------------------------------------------

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._eof:
            return
        if self._head_done and self._until_close and exc is None:
            self._eof = True  # the close is this body's end
        else:
            self._set_error(UpstreamClosedError(f"replica closed the connection mid-response ({exc!r})"))
        self._wake()

    def _set_error(self, error: Exception) -> None:
        if self._error is None and not self._eof:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._pool._waiting.discard(self)
            if not waiter.done():
                waiter.set_result(None)

    def _expire(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_exception(UpstreamTimeoutError("replica sent nothing within the read timeout"))

    # -- reading ---------------------------------------------------------------------------------

    @property
    def head_done(self) -> bool:
        return self._head_done

    def progress(self) -> asyncio.Future[None]:
        """A future that resolves when the parser makes progress, and fails with the connection's error
        or ``UpstreamTimeoutError`` after ``read_timeout_s`` of silence.

        A plain future awaited by the caller, not a coroutine, and no timer of its own: a proxied
        request waits here once, and each coroutine layer and timer on that path is CPU per request.
        """
        if self._error is not None:
            raise self._error
        waiter = self._loop.create_future()
        self._waiter = waiter
        self.deadline_s = self._loop.time() + self._read_timeout_s
        self._pool._watch(self)
        return waiter

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some), or b"" at the end of the body."""
        while not self._chunks:
            if self._eof:
                return b""
            await self.progress()
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._drain())
        self._buffered -= len(data)
        if self._paused and self._buffered <= HIGH_WATER_BYTES // 4:
            self._paused = False
            self._conn.resume()
        return data

    def _drain(self) -> list[bytes]:
        chunks = list(self._chunks)
        self._chunks.clear()
        return chunks

    def at_eof(self) -> bool:
        """The whole body has been read."""
        return self._eof and not self._chunks

    def release(self) -> None:
        """Done with a fully read response: its connection may serve the next request."""
        if self._done:
            return
        self._done = True
        self._pool._waiting.discard(self)
        conn = self._conn
        keep = self._eof and self._keep_alive and not self._until_close
        conn.finish()
        if keep:
            self._pool._put_back(conn)
        else:
            self._pool._discard(conn)

    def close(self) -> None:
        """Abandon the response: its connection is closed, so the replica stops working on it."""
        if self._done:
            return
        self._done = True
        self._pool._waiting.discard(self)
        self._conn.finish()
        self._pool._discard(self._conn)


class _OriginPool:
    def __init__(self, key: str, origin: _Origin) -> None:
        self.key = key
        self.origin = origin
        self.closed = False
        self.sweep: asyncio.TimerHandle | None = None
        self.idle: list[_Connection] = []  # most recently used last
        self.open = 0  # idle + in use + connecting
        self.waiters: deque[asyncio.Future[None]] = deque()


class UpstreamPool:
    """Keep-alive connections per replica origin (scheme, host, port), at most ``max_connections_per_origin``
    each; a request beyond that waits for a connection to come free, at most ``pool_wait_timeout_s``."""

    def __init__(self, settings: PoolSettings) -> None:
        self._settings = settings
        self._pools: dict[str, _OriginPool] = {}
        self._ssl: ssl.SSLContext | None = None
        # Responses waiting on a replica, checked against their deadlines by one sweep (not a timer each).
        self._waiting: set[UpstreamResponse] = set()
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

    def _send_on(self, conn: _Connection, path_qs: str, headers: bytes, body: bytes) -> UpstreamResponse:
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

    def _watch(self, response: UpstreamResponse) -> None:
        self._waiting.add(response)
        if self._deadline_sweep is None:
            loop = asyncio.get_running_loop()
            self._deadline_sweep = loop.call_later(self._sweep_interval_s, self._expire_waiting)

    def _expire_waiting(self) -> None:
        """Fail the waits that passed their deadline: the read timeout fires up to one interval late."""
        self._deadline_sweep = None
        loop = asyncio.get_running_loop()
        now_s = loop.time()
        for response in [r for r in self._waiting if r.deadline_s <= now_s]:
            self._waiting.discard(response)
            response._expire()
        if self._waiting:
            self._deadline_sweep = loop.call_later(self._sweep_interval_s, self._expire_waiting)

    def _origin_pool(self, base_url: str) -> _OriginPool:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"replica url must be http(s)://host:port, got {base_url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        host_header = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        pool = _OriginPool(base_url, _Origin(parts.scheme, host, port, host_header.encode("idna")))
        self._pools[base_url] = pool
        return pool

    def _idle_connection(self, pool: _OriginPool) -> _Connection | None:
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

    async def _acquire(self, pool: _OriginPool) -> _Connection:
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

    async def _connect(self, pool: _OriginPool) -> _Connection:
        loop = asyncio.get_running_loop()
        origin = pool.origin
        ssl_context: ssl.SSLContext | None = None
        if origin.scheme == "https":
            ssl_context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(pool), origin.host, origin.port, ssl=ssl_context
                )
        except TimeoutError:
            raise UpstreamConnectTimeoutError(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as e:
            raise UpstreamConnectError(f"connect to {origin.host}:{origin.port} failed: {e}") from e
        return conn

    def _put_back(self, conn: _Connection) -> None:
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

    def _sweep(self, pool: _OriginPool) -> None:
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

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        pool = conn.owner
        pool.open -= 1
        self._wake_one(pool)

    @staticmethod
    def _wake_one(pool: _OriginPool) -> None:
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
