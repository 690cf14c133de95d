"""``UpstreamResponse``: a replica's answer as llhttp parses it, read with flow control.

It is the parser's callback object and the reader's handle at once: the head and body arrive
through the ``on_*`` callbacks, a reader waits on ``progress`` (a plain future, no timer of its own:
the pool's one sweep enforces the read timeout) and takes bytes with ``readany``; past
``HIGH_WATER_BYTES`` buffered, reading from the socket pauses until the reader catches up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from kvfleet.router.upstream.errors import UpstreamClosedError, UpstreamTimeoutError

if TYPE_CHECKING:
    from kvfleet.router.upstream.connection import ReplicaConnection
    from kvfleet.router.upstream.pool import UpstreamPool

# Body bytes buffered from a replica before reading from its socket pauses (backpressure from a slow client).
HIGH_WATER_BYTES = 256 * 1024


class UpstreamResponse:
    """A replica's answer: ``status``, ``reason`` and ``raw_headers`` once the head is in, then ``readany``.

    Used as ``with response:``, it is released exactly once: on a normal exit ``release`` (a fully read
    answer's connection goes back to the pool, an unfinished one is closed), on an exception ``close``
    (the replica must see the request go away). ``release`` and ``close`` may also be called directly.
    It is also the httptools parser's callback object (the ``on_*`` methods).
    """

    def __init__(self, pool: UpstreamPool, connection: ReplicaConnection, read_timeout_s: float) -> None:
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
        parser = self._conn.parser
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

    # -- from the connection and the pool (this package's own, not its interface) ------------------

    def connection_closed(self, exc: Exception | None) -> None:
        if self._eof:
            return
        if self._head_done and self._until_close and exc is None:
            self._eof = True  # the close is this body's end
        else:
            self.fail(UpstreamClosedError(f"replica closed the connection mid-response ({exc!r})"))
        self._wake()

    def fail(self, error: Exception) -> None:
        if self._error is None and not self._eof:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._pool.waiting.discard(self)
            if not waiter.done():
                waiter.set_result(None)

    def expire(self) -> None:
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
        self._pool.watch(self)
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
        self._pool.waiting.discard(self)
        conn = self._conn
        keep = self._eof and self._keep_alive and not self._until_close
        conn.finish()
        if keep:
            self._pool.put_back(conn)
        else:
            self._pool.discard(conn)

    def close(self) -> None:
        """Abandon the response: its connection is closed, so the replica stops working on it."""
        if self._done:
            return
        self._done = True
        self._pool.waiting.discard(self)
        self._conn.finish()
        self._pool.discard(self._conn)
