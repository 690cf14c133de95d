"""One keep-alive connection to a replica (``ReplicaConnection``) and its origin's bookkeeping.

The connection feeds the bytes it reads to the parser of the response it is serving; when the
replica closes an idle connection it takes itself out of its ``OriginPool`` (the pool's idle list
and open count), which is why that bookkeeping lives beside it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import httptools

from kvfleet.router.upstream.errors import UpstreamClosedError

if TYPE_CHECKING:
    from kvfleet.router.upstream.response import UpstreamResponse


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int
    host_header: bytes


class ReplicaConnection(asyncio.Protocol):
    """One keep-alive connection; serves one response at a time."""

    def __init__(self, owner: OriginPool) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since_s = 0.0
        self._response: UpstreamResponse | None = None
        self.parser: httptools.HttpResponseParser | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # bytes while idle: the replica broke the protocol; drop the connection
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamClosedError("replica switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(UpstreamClosedError(f"malformed response from replica: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._response is not None:
            self._response.connection_closed(exc)
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
        self.parser = httptools.HttpResponseParser(response)
        self.transport.write(request)

    def finish(self) -> None:
        self._response = None
        self.parser = None

    def reusable(self) -> bool:
        return not self.closed and self.parser is None and self.transport is not None

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
            self._response.fail(error)
        self.close()


class OriginPool:
    """The pool's state for one origin: idle connections, how many are open, who waits for one."""

    def __init__(self, key: str, origin: Origin) -> None:
        self.key = key
        self.origin = origin
        self.closed = False
        self.sweep: asyncio.TimerHandle | None = None
        self.idle: list[ReplicaConnection] = []  # most recently used last
        self.open = 0  # idle + in use + connecting
        self.waiters: deque[asyncio.Future[None]] = deque()
