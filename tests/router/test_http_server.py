"""The router's HTTP/1.1 server over real sockets: framing, keep-alive, pipelining, limits, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest

from kvfleet.router.http_server import Handler, HttpRequest, HttpServer, HttpServerSettings, Responder

SETTINGS = HttpServerSettings(max_body_bytes=1024, keepalive_timeout_s=30.0, shutdown_timeout_s=5.0)


async def echo(request: HttpRequest, responder: Responder) -> None:
    """Answers with what it saw; ``/stream`` streams three chunks, ``/slow`` waits first."""
    if request.path == "/slow":
        await asyncio.sleep(0.3)
    if request.path == "/stream":
        responder.start(200, [("Content-Type", "text/plain")])
        for i in range(3):
            await responder.write(f"part{i};".encode())
            await asyncio.sleep(0.01)
        responder.end()
        return
    seen = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "body": request.body.decode(),
        "too_large": request.body_too_large,
        "version": request.http_version,
        "remote": request.remote,
    }
    responder.send(200, [("Content-Type", "application/json")], json.dumps(seen).encode())


@asynccontextmanager
async def serving(settings: HttpServerSettings = SETTINGS, handler: Handler = echo) -> AsyncIterator[HttpServer]:
    server = HttpServer(handler, settings)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response off a raw connection (Content-Length or chunked framing)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    return status, headers, await reader.read()


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        # Three requests in one write; the first is slow, so the answers must still come in order.
        writer.write(
            b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
            b"POST /b?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo"
            b"GET /c HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answers = [json.loads((await read_response(reader))[2]) for _ in range(3)]
        assert [(a["path"], a["body"]) for a in answers] == [("/slow", "one"), ("/b", "two"), ("/c", "")]
        assert answers[1]["query"] == "q=1"
        assert answers[0]["remote"] == "127.0.0.1"
        # The connection is still open for more.
        writer.write(b"GET /d HTTP/1.1\r\nHost: x\r\n\r\n")
        assert json.loads((await read_response(reader))[2])["path"] == "/d"
        writer.close()


async def test_chunked_request_body_and_streamed_chunked_response() -> None:
    async with serving() as server, aiohttp.ClientSession() as session:

        async def body() -> AsyncIterator[bytes]:
            for part in (b"ab", b"cd", b"ef"):
                yield part

        async with session.post(f"http://127.0.0.1:{server.port}/x", data=body()) as resp:
            assert json.loads(await resp.read())["body"] == "abcdef"
        async with session.get(f"http://127.0.0.1:{server.port}/stream") as resp:
            assert resp.headers["Transfer-Encoding"] == "chunked"
            assert await resp.read() == b"part0;part1;part2;"


async def test_http_1_0_gets_its_framing_and_a_close() -> None:
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
        raw = await reader.read()  # until the server closes: that is the body's end in HTTP/1.0
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") and b"Connection: close" in head
        assert body == b"part0;part1;part2;"
        writer.close()


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hi")
        assert json.loads((await read_response(reader))[2])["body"] == "hi"
        writer.close()


async def test_body_over_the_limit_is_read_and_flagged_and_the_connection_lives_on() -> None:
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        big = b"x" * 5000
        writer.write(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big))
        seen = json.loads((await read_response(reader))[2])
        assert seen["too_large"] is True and seen["body"] == ""
        writer.write(b"POST /small HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
        assert json.loads((await read_response(reader))[2])["body"] == "ok"
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 501),
    ],
)
async def test_malformed_requests_get_an_error_and_a_close(raw: bytes, status: int) -> None:
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(raw)
        got, headers, body = await read_response(reader)
        assert got == status and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] is None
        assert await reader.read() == b""  # closed
        writer.close()


@pytest.mark.parametrize(
    "raw",
    [
        # Request smuggling shapes: both framings, or two lengths that disagree.
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    ],
)
async def test_ambiguous_request_framing_is_refused(raw: bytes) -> None:
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(raw)
        status, headers, _ = await read_response(reader)
        assert status == 400 and headers["connection"] == "close"
        assert await reader.read() == b""
        writer.close()


BOUNDED = HttpServerSettings(
    max_body_bytes=1024,
    keepalive_timeout_s=30.0,
    shutdown_timeout_s=1.0,
    max_head_bytes=4096,
    max_headers=20,
    head_timeout_s=0.3,
    max_connections=6,
    max_connections_per_client=4,
)


async def refused_with(reader: asyncio.StreamReader, status: int) -> str:
    got, headers, body = await read_response(reader)
    assert got == status and headers["connection"] == "close"
    assert await reader.read() == b""  # closed after the answer
    return str(json.loads(body)["error"]["message"])


async def test_a_head_larger_than_the_limit_gets_431_whether_it_comes_whole_or_in_pieces() -> None:
    async with serving(BOUNDED) as server:
        # One header line of 20 MB, written in pieces: refused long before it is all sent.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(20 * 16):
                writer.write(b"a" * 65536)
                await writer.drain()
                if answered(reader):
                    break
        assert "larger than the limit of 4096 bytes" in await refused_with(reader, 431)
        writer.close()
        # A whole head just over the limit in one write (llhttp sees it complete in one read).
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
        assert "4096 bytes" in await refused_with(reader, 431)
        writer.close()
        # A long request target counts too.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert "request target" in await refused_with(reader, 431)
        writer.close()
        # Just under the limit is served, and the connection stays usable.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 3900 + b"\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.write(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()
        assert server.refusals == {431: 3}


async def test_more_header_fields_than_the_limit_get_431() -> None:
    async with serving(BOUNDED) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(50)) + b"\r\n")
        assert "more than 20 header fields" in await refused_with(reader, 431)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(19)) + b"\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()


async def test_a_head_that_drips_in_slower_than_the_head_timeout_gets_408() -> None:
    async with serving(BOUNDED) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\n")
        start = asyncio.get_running_loop().time()
        with contextlib.suppress(ConnectionError):
            for _ in range(40):  # a header byte every 50 ms: active, but the head never completes
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.05)
                if answered(reader):
                    break
        assert "not complete within 0.3 s" in await refused_with(reader, 408)
        assert asyncio.get_running_loop().time() - start < 1.5  # within 1.5x the timeout, plus slack
        writer.close()
        # After a served request, the next head's clock starts at its own first byte.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        await asyncio.sleep(0.5)  # idle between requests is the keep-alive timeout's business
        writer.write(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()


async def test_connections_past_the_per_client_and_total_caps_get_503_and_a_close() -> None:
    async with serving(BOUNDED) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(4)]
        await until_true(lambda: len(server.connections) == 4)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert "limit of 4 connections per client" in await refused_with(reader, 503)
        writer.close()
        # Another client address (127.0.0.2 is loopback too) may still connect, up to the total cap of 6.
        more = [await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0)) for _ in range(2)]
        await until_true(lambda: len(server.connections) == 6)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
        assert "limit of 6 connections" in await refused_with(reader, 503)
        writer.close()
        # Held connections work, and a closed one frees its place.
        r0, w0 = held[0]
        w0.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(r0))[0] == 200
        w0.close()
        await until_true(lambda: len(server.connections) == 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        assert server.clients.per_client == {"127.0.0.1": 4, "127.0.0.2": 2}
        for _, w in [*held[1:], *more, (reader, writer)]:
            w.close()
        assert server.refusals == {503: 2}


def answered(reader: asyncio.StreamReader) -> bool:
    """Whether the server has answered (or closed) while the client is still sending."""
    return reader.at_eof() or bool(reader._buffer)  # no public peek on StreamReader


async def until_true(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_idle_client_connections_are_closed_after_the_keepalive_timeout() -> None:
    settings = HttpServerSettings(max_body_bytes=1024, keepalive_timeout_s=0.2, shutdown_timeout_s=1.0)
    async with serving(settings) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await read_response(reader)
        assert await asyncio.wait_for(reader.read(), timeout=2.0) == b""
        assert not server.connections
        writer.close()


async def test_a_client_that_goes_away_cancels_its_handler() -> None:
    cancelled = asyncio.Event()

    async def forever(request: HttpRequest, responder: Responder) -> None:
        responder.start(200, [("Content-Type", "text/plain")])
        try:
            while True:
                await responder.write(b".")
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with serving(handler=forever) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await asyncio.wait_for(cancelled.wait(), timeout=5.0)


async def test_close_lets_in_flight_requests_finish_and_stops_listening() -> None:
    server = HttpServer(echo, SETTINGS)
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.05)  # the handler is running
    closing = asyncio.create_task(server.close())
    status, headers, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/slow"
    assert headers["connection"] == "close"  # no keep-alive while shutting down
    await asyncio.wait_for(closing, timeout=5.0)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)
    writer.close()


async def test_close_cancels_requests_that_outlive_the_grace_period() -> None:
    started = asyncio.Event()

    async def stuck(request: HttpRequest, responder: Responder) -> None:
        started.set()
        await asyncio.sleep(60)

    settings = HttpServerSettings(max_body_bytes=1024, keepalive_timeout_s=30.0, shutdown_timeout_s=0.2)
    server = HttpServer(stuck, settings)
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await started.wait()
    await asyncio.wait_for(server.close(), timeout=5.0)
    assert await reader.read() == b""  # dropped, not left hanging
    writer.close()
