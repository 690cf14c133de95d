"""The router's HTTP/1.1 client to replicas, against real loopback servers that answer raw HTTP bytes
(so each framing -- length, chunked, until-close -- and each failure is exactly what the test wrote)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest

from kvfleet.router.upstream import (
    PoolSettings,
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeoutError,
)
from tests.conftest import pick_free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Counts connections and the requests each carried; ``handler`` writes the answer bytes."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = 0
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                await self.handler(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[RawServer, str]]:
    state = RawServer(handler)
    port = pick_free_port()
    server = await asyncio.start_server(state.serve, "127.0.0.1", port)
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def settings(**overrides: float) -> PoolSettings:
    values: dict[str, float] = {
        "max_connections_per_origin": 4,
        "keepalive_timeout_s": 30.0,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 5.0,
    }
    values.update(overrides)
    return PoolSettings(
        max_connections_per_origin=int(values["max_connections_per_origin"]),
        keepalive_timeout_s=values["keepalive_timeout_s"],
        connect_timeout_s=values["connect_timeout_s"],
        read_timeout_s=values["read_timeout_s"],
    )


async def send_for_head(
    pool: UpstreamPool, url: str, path_qs: str = "/", headers: bytes = b"", body: bytes = b"{}"
) -> UpstreamResponse:
    """Send, then wait for the response head (as the proxy does before it reads the body)."""
    response = await pool.send(url, path_qs, headers, body)
    with response_closed_on_error(response):
        while not response.head_done:
            await response.progress()
    return response


@contextmanager
def response_closed_on_error(response: UpstreamResponse) -> Iterator[None]:
    try:
        yield
    except BaseException:
        response.close()
        raise


async def read_all(pool: UpstreamPool, url: str, body: bytes = b"{}") -> tuple[int, bytes]:
    parts = []
    # The block releases the response: its connection goes back to the pool once read to the end.
    with await send_for_head(pool, url, "/v1/completions?x=1", b"Content-Type: application/json\r\n", body) as response:
        while chunk := await response.readany():
            parts.append(chunk)
    return response.status, b"".join(parts)


async def answer_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}')
    await writer.drain()


async def test_keep_alive_connection_is_reused_and_the_request_is_sent_whole() -> None:
    async with raw_server(answer_json) as (server, url):
        pool = UpstreamPool(settings())
        try:
            for _ in range(3):
                assert await read_all(pool, url, b'{"model":"m"}') == (200, b'{"ok":true}')
        finally:
            await pool.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 13\r\n" in first and first.endswith(b'\r\n\r\n{"model":"m"}')


async def test_chunked_body_is_decoded_and_read_until_close_body_ends_at_the_close() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    pool = UpstreamPool(settings())
    try:
        async with raw_server(chunked) as (server, url):
            with await send_for_head(pool, url) as response:
                assert response.content_type == "text/event-stream"
                got = [await response.readany(), await response.readany(), await response.readany()]
                assert got == [b"data: 1\n\n", b"data: 2\n\n", b""] and response.at_eof()
        async with raw_server(until_close) as (server, url):
            assert await read_all(pool, url) == (200, b"all of it")
            assert await read_all(pool, url) == (200, b"all of it")
            assert server.connections == 2  # a body that ends with the close never goes back to the pool
    finally:
        await pool.close()


async def test_a_body_cut_short_is_an_error_not_a_clean_end() -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    async with raw_server(short) as (_, url):
        pool = UpstreamPool(settings())
        try:
            response = await send_for_head(pool, url)
            assert await response.readany() == b"only this"
            with pytest.raises(UpstreamClosedError):
                await response.readany()
            response.close()
        finally:
            await pool.close()


async def test_silence_times_out_and_a_refused_connect_is_a_connect_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    pool = UpstreamPool(settings(read_timeout_s=0.2))
    try:
        async with raw_server(silent) as (_, url):
            with pytest.raises(UpstreamTimeoutError):
                await send_for_head(pool, url)
        with pytest.raises(UpstreamConnectError):
            await send_for_head(pool, f"http://127.0.0.1:{pick_free_port()}")
    finally:
        await pool.close()


async def test_pool_bound_makes_requests_wait_and_idle_connections_are_closed_after_keepalive() -> None:
    release_first = asyncio.Event()

    async def slow_then_fast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not release_first.is_set():
            await release_first.wait()
        await answer_json(reader, writer)

    async with raw_server(slow_then_fast) as (server, url):
        pool = UpstreamPool(settings(max_connections_per_origin=1, keepalive_timeout_s=0.2))
        try:
            first = asyncio.create_task(read_all(pool, url))
            second = asyncio.create_task(read_all(pool, url))
            await asyncio.sleep(0.2)
            assert server.connections == 1 and not second.done()  # waiting for the one allowed connection
            release_first.set()
            assert await first == (200, b'{"ok":true}') and await second == (200, b'{"ok":true}')
            assert server.connections == 1
            for _ in range(50):  # the keep-alive sweep closes the idle connection
                if server.closed:
                    break
                await asyncio.sleep(0.05)
            assert server.closed == 1
            assert await read_all(pool, url) == (200, b'{"ok":true}')  # and a new one is opened
            assert server.connections == 2
        finally:
            await pool.close()


async def test_a_response_block_that_raises_closes_its_connection_and_a_normal_one_reuses_it() -> None:
    async with raw_server(answer_json) as (server, url):
        pool = UpstreamPool(settings())
        try:
            with pytest.raises(RuntimeError), await send_for_head(pool, url) as response:
                assert response.status == 200
                raise RuntimeError("the client went away")  # mid-read: the replica must see the request go
            for _ in range(50):
                if server.closed:
                    break
                await asyncio.sleep(0.01)
            assert server.closed == 1
            assert await read_all(pool, url) == (200, b'{"ok":true}')  # a new connection, kept after a clean end
            assert await read_all(pool, url) == (200, b'{"ok":true}')
            assert server.connections == 2
        finally:
            await pool.close()
