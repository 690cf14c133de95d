"""The engine server's front-end bounds over real sockets (the same bounds as the router's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvfleet.engine.connection_guard import GuardedTCPSite
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.server import ServerState, create_app, start_site
from kvfleet.engine.settings import ServerSettings

SETTINGS = ServerSettings(
    port=0,
    served_model_name="m",
    max_head_bytes=4096,
    max_headers=20,
    head_timeout_s=0.3,
    max_connections=6,
    max_connections_per_client=4,
)
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"


@asynccontextmanager
async def serving() -> AsyncIterator[GuardedTCPSite]:
    state = ServerState(SETTINGS, "m", EngineMetrics("m"))  # no engine loaded: /v1/models still answers
    runner, site = await start_site(create_app(state), SETTINGS)
    try:
        yield site
    finally:
        await runner.cleanup()


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    length = next(int(h.split(":")[1]) for h in head if h.lower().startswith("content-length"))
    return int(head[0].split()[1]), await reader.readexactly(length)


async def refused(reader: asyncio.StreamReader, status: int) -> str:
    got, body = await answer(reader)
    assert got == status
    assert await reader.read() == b""
    return str(json.loads(body)["error"]["message"])


def answered(reader: asyncio.StreamReader) -> bool:
    return reader.at_eof() or bool(reader._buffer)  # no public peek on StreamReader


async def test_head_size_and_field_count_are_bounded_with_431() -> None:
    async with serving() as site:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(MODELS + b"X-Big: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(320):  # up to a 20 MB header line, in pieces
                writer.write(b"a" * 65536)
                await writer.drain()
                if answered(reader):
                    break
        assert "larger than the limit of 4096 bytes" in await refused(reader, 431)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(MODELS + b"".join(b"X-%d: 1\r\n" % i for i in range(50)) + b"\r\n")
        assert "more than 20 header fields" in await refused(reader, 431)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(MODELS + b"X-Ok: " + b"a" * 3800 + b"\r\n\r\n")
        status, body = await answer(reader)
        assert status == 200 and json.loads(body)["data"][0]["id"] == "m"
        writer.write(MODELS + b"\r\n")  # keep-alive still works after a large head
        assert (await answer(reader))[0] == 200
        writer.close()
        assert site.guard.refusals == {431: 2}


async def test_a_slow_head_gets_408() -> None:
    async with serving() as site:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(40):
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.05)
                if answered(reader):
                    break
        assert "not complete within 0.3 s" in await refused(reader, 408)
        writer.close()


async def test_connection_caps_per_client_and_in_total_get_503() -> None:
    async with serving() as site:
        held = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(4)]
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        assert "limit of 4 connections per client" in await refused(reader, 503)
        writer.close()
        more = [await asyncio.open_connection("127.0.0.1", site.port, local_addr=("127.0.0.2", 0)) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port, local_addr=("127.0.0.2", 0))
        assert "limit of 6 connections" in await refused(reader, 503)
        writer.close()
        r0, w0 = held[0]
        w0.write(MODELS + b"\r\n")
        assert (await answer(r0))[0] == 200
        for _, w in [*held, *more]:
            w.close()
