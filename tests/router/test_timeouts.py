"""Waits on a replica that run out, by phase, through the router over HTTP against a real aiohttp replica
in this process (so the test decides exactly when it answers)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from kvfleet.router.errors import GatewayTimeoutError, UpstreamAttemptError, UpstreamBusyError
from kvfleet.router.forward import upstream_failure
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.upstream import (
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamConnectTimeoutError,
    UpstreamPoolTimeoutError,
    UpstreamTimeoutError,
)
from kvfleet.spec import RoutingSpec
from tests.conftest import pick_free_port

from .conftest import running_router, until


class HeldReplica:
    """``/v1/completions``: a stream of events every 50 ms until ``release`` is set (a long generation:
    never silent, so only the pool's wait can bound a request queued behind it); ``/quiet``: silence."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.received += 1
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while not self.release.is_set():
            await response.write(b'data: {"choices": [{"text": "tick"}]}\n\n')
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def quiet(self, request: web.Request) -> web.Response:
        self.received += 1
        await self.release.wait()
        return web.json_response({})


@asynccontextmanager
async def held_replica() -> AsyncIterator[tuple[HeldReplica, str]]:
    replica = HeldReplica()
    app = web.Application()
    app.router.add_post("/v1/completions", replica.completions)
    app.router.add_post("/v1/chat/completions", replica.quiet)
    runner = web.AppRunner(app)
    await runner.setup()
    port = pick_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield replica, f"http://127.0.0.1:{port}"
    finally:
        replica.release.set()
        await runner.cleanup()


def metric(text: str, name: str, labels: str) -> float:
    prefix = f"{name}{{{labels}}} "
    values = [float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


async def test_a_full_connection_pool_answers_503_with_a_reason_after_the_pool_wait() -> None:
    async with held_replica() as (replica, url):
        source = StaticReplicaSource()
        source.set_deployment("busy", routing=RoutingSpec(strategy="round-robin"))
        source.add("busy", "busy-0", url)
        settings = {"pool_connections_per_replica": 1, "pool_wait_timeout_s": 0.3, "idle_read_timeout_s": 5.0}
        async with running_router(source, **settings) as router, aiohttp.ClientSession() as session:
            body = {"model": "busy", "prompt": "hello"}
            holder = asyncio.create_task(session.post(router.url + "/v1/completions", json=body))
            await until(lambda: replica.received == 1)  # the pool's one connection is in use
            started = time.monotonic()
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                waited_s = time.monotonic() - started
                status, headers, error = resp.status, resp.headers, (await resp.json())["error"]
            assert status == 503, error
            assert headers["Retry-After"] == "2"  # RouterSettings.retry_after_s
            assert error["code"] == "upstream_busy" and error["type"] == "upstream_busy"
            assert "busy-0 is at this router's connection limit" in error["message"]
            assert "all 1 connections" in error["message"] and "0.3 s" in error["message"]
            # Bounded by the pool wait, not by idle_read_timeout_s (5 s); nothing reached the replica.
            assert 0.25 <= waited_s < 2.0
            assert replica.received == 1
            text = await (await session.get(router.url + "/metrics")).text()
            labels = 'model="busy",namespace="default",phase="pool"'
            assert metric(text, "kvfleet_router_upstream_timeouts_total", labels) == 1.0
            assert metric(text, "kvfleet_router_requests_total", 'code="503",model="busy",namespace="default"') == 1

            # The held request is unharmed, and once its connection is free the next one goes through.
            replica.release.set()
            first = await holder
            assert first.status == 200 and (await first.read()).endswith(b"data: [DONE]\n\n")
            first.release()
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
            assert replica.received == 2
            assert router.fleet.inflight("busy") == {"busy-0": 0}


@pytest.mark.parametrize(
    ("error", "head_done", "phase", "mapped", "text"),
    [
        (
            UpstreamPoolTimeoutError("all 1 connections to h:1 stayed in use for 5 s"),
            False,
            "pool",
            UpstreamBusyError,
            "connection limit",
        ),
        (
            UpstreamClosedError("the router is shutting down"),
            False,
            "head",
            UpstreamAttemptError,
            "UpstreamClosedError",
        ),
        (UpstreamConnectTimeoutError("connect to h:1 timed out"), False, "connect", UpstreamAttemptError, "timed out"),
        (UpstreamConnectError("connect to h:1 failed"), False, "connect", UpstreamAttemptError, "failed"),
        (UpstreamTimeoutError("silent"), False, "head", GatewayTimeoutError, "no response headers in time"),
        (UpstreamTimeoutError("silent"), True, "body", GatewayTimeoutError, "no response body in time"),
        (UpstreamClosedError("reset"), True, "body", UpstreamAttemptError, "broke before the first byte"),
    ],
)
def test_each_failure_before_the_first_byte_maps_by_its_phase(
    error: Exception, head_done: bool, phase: str, mapped: type, text: str
) -> None:
    assert isinstance(
        error, (UpstreamClosedError, UpstreamConnectError, UpstreamTimeoutError, UpstreamPoolTimeoutError)
    )
    got_phase, got = upstream_failure(error, "r0", head_done=head_done, retry_after_s=2)
    assert got_phase == phase and type(got) is mapped and text in str(got)
    if isinstance(got, UpstreamBusyError):
        assert got.status == 503 and got.retry_after_s == 2


async def test_a_silent_replica_counts_a_head_timeout() -> None:
    async with held_replica() as (_, url):
        source = StaticReplicaSource()
        source.set_deployment("quiet", routing=RoutingSpec(strategy="round-robin"))
        source.add("quiet", "quiet-0", url)
        async with running_router(source, idle_read_timeout_s=0.3) as router, aiohttp.ClientSession() as session:
            chat = {"model": "quiet", "messages": [{"role": "user", "content": "x"}]}
            async with session.post(router.url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 504
                assert "no response headers in time" in json.loads(await resp.read())["error"]["message"]
            text = await (await session.get(router.url + "/metrics")).text()
            labels = 'model="quiet",namespace="default",phase="head"'
            assert metric(text, "kvfleet_router_upstream_timeouts_total", labels) == 1.0
