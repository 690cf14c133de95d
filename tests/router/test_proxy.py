"""The router end to end over HTTP, against real backend processes (tests/router/backend.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.wake import InProcessWakeSignal
from kvfleet.spec import RoutingSpec

from .conftest import Backend, running_router, until

SYSTEM = "You are a careful assistant for the ACME support desk. Answer briefly and cite the manual. " * 4


def source_for(model: str, replicas: list[Backend], routing: RoutingSpec | None = None) -> StaticReplicaSource:
    source = StaticReplicaSource()
    source.set_deployment(model, routing=routing or RoutingSpec(prefix_block_chars=16))
    for backend in replicas:
        source.add(model, backend.replica_id, backend.url)
    return source


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, dict[str, str], bytes]:
    async with session.post(url + path, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_shared_system_prompt_sticks_to_one_replica_within_the_bound(backends: list[Backend]) -> None:
    source = source_for("shared", backends)
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        # One at a time: every request sharing the system prompt goes where the prefix is cached.
        seen = []
        for i in range(12):
            status, headers, _ = await post(session, router.url, {"model": "shared", "prompt": f"{SYSTEM} Q{i}?"})
            assert status == 200
            seen.append(headers["X-Kvfleet-Replica"])
        assert len(set(seen)) == 1, seen
        hot = seen[0]
        # A burst held open at once: the hot replica takes most, but never more than the bound allows.
        burst = 40
        bodies = [
            {"model": "shared", "prompt": f"{SYSTEM} B{i}?", "kvfleet_test": {"hold_s": 0.5}} for i in range(burst)
        ]
        results = await asyncio.gather(*(post(session, router.url, b) for b in bodies))
        assert all(status == 200 for status, _, _ in results)
        per_replica = Counter(headers["X-Kvfleet-Replica"] for _, headers, _ in results)
        cap = math.ceil(1.25 * burst / len(backends))
        assert max(per_replica.values()) <= cap, per_replica
        assert per_replica.most_common(1)[0][0] == hot


async def test_distinct_prompts_spread_like_least_load(backends: list[Backend]) -> None:
    source = source_for("spread", backends)
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        bodies = [
            {"model": "spread", "prompt": f"{i:04d} unrelated prompt number {i} " * 3, "kvfleet_test": {"hold_s": 0.3}}
            for i in range(20)
        ]
        results = await asyncio.gather(*(post(session, router.url, b) for b in bodies))
        per_replica = Counter(headers["X-Kvfleet-Replica"] for _, headers, _ in results)
        assert sorted(per_replica.values()) == [5, 5, 5, 5]


async def test_streaming_bytes_arrive_unchanged_chunk_by_chunk(backends: list[Backend]) -> None:
    source = source_for("stream", backends[:1])
    body = {"model": "stream", "prompt": "hello", "stream": True, "kvfleet_test": {"chunks": 20, "delay_s": 0.05}}
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        async with session.post(backends[0].url + "/v1/completions", json=body) as direct:
            expected = await direct.read()
        arrivals: list[float] = []
        received = b""
        loop = asyncio.get_running_loop()
        async with session.post(router.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            async for chunk in resp.content.iter_any():
                arrivals.append(loop.time())
                received += chunk
    assert received == expected
    assert received.endswith(b"data: [DONE]\n\n")
    # Passed through as produced (20 chunks 50 ms apart), not buffered whole and sent at the end.
    assert len(arrivals) >= 10
    assert arrivals[-1] - arrivals[0] >= 0.5


async def test_waiting_counts_until_the_first_body_byte(backends: list[Backend]) -> None:
    """Held before the headers: waiting and in flight; first chunk relayed: in flight only; done: neither."""
    source = source_for("first-byte", backends[:1])
    body = {
        "model": "first-byte",
        "prompt": "x",
        "stream": True,
        "kvfleet_test": {"hold_s": 0.5, "chunks": 2, "delay_s": 0.5},
    }
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        fleet = router.fleet
        # The router answers the client only with the first body byte, so the held part is watched from here.
        opened = asyncio.create_task(session.post(router.url + "/v1/completions", json=body))
        await until(lambda: fleet.inflight("first-byte") == {"r0": 1})
        assert fleet.waiting("first-byte") == {"r0": 1}
        async with await opened as resp:
            assert (fleet.inflight("first-byte"), fleet.waiting("first-byte")) == ({"r0": 1}, {"r0": 0})
            assert b"w1" in await resp.read()
        await until(lambda: fleet.inflight("first-byte") == {"r0": 0})
        assert fleet.waiting("first-byte") == {"r0": 0}


async def test_bad_input_gets_clear_4xx(backends: list[Backend]) -> None:
    source = source_for("known", backends[:1])
    # Room for JSON nested 100,000 deep: past any interpreter's recursion limit (torch raises it to 2,000
    # in a process that compiled), so the parser's own bound is what answers.
    async with running_router(source, max_body_bytes=300_000) as router, aiohttp.ClientSession() as session:
        url = router.url + "/v1/completions"
        cases: list[tuple[bytes, int, str]] = [
            (b"{not json", 400, "not valid JSON"),
            (b"[1, 2]", 400, "JSON object"),
            (b'{"prompt": "x"}', 400, "'model' is required"),
            (b'{"model": "nope", "prompt": "x"}', 404, "'nope' is not served"),
            (b'{"model": "known", "messages": "x"}', 400, "'messages' must be a list"),
            (b'{"model": "known", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),
            (json.dumps({"model": "known", "prompt": "x" * 400_000}).encode(), 413, "larger than"),
        ]
        for raw, status, reason in cases:
            async with session.post(url, data=raw, headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == status, raw[:40]
                error = (await resp.json())["error"]
                assert reason in error["message"], error
                codes = {400: None, 404: "model_not_found", 413: "request_too_large"}
                assert (error["code"], "type" in error, "param" in error) == (codes[status], True, True), error
        async with session.get(router.url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["known"]
        async with session.get(router.url + "/metrics") as resp:
            text = await resp.text()
        assert 'kvfleet_router_requests_total{code="404",model="",namespace=""} 1.0' in text
        assert 'kvfleet_router_requests_total{code="413",model="",namespace=""} 1.0' in text
        # Requests the router refuses itself are not the model's arrivals (the autoscaler reads this series).
        assert 'kvfleet_router_requests_total{code="400",model="",namespace=""} 5.0' in text
        assert 'code="400",model="known"' not in text


async def test_activator_holds_requests_at_zero_and_serves_all_when_a_replica_appears(
    spawn_backend: Callable[[str], Backend],
) -> None:
    source = StaticReplicaSource()
    source.set_deployment("cold", routing=RoutingSpec(max_queue=50, max_queue_wait_seconds=60), namespace="ns1")
    wakes: list[tuple[str, str]] = []
    depth_at_wake: list[int] = []

    async def wake(namespace: str, name: str) -> None:
        # The autoscaler's part, in process: start a replica and announce it, as local mode would.
        wakes.append((namespace, name))
        await asyncio.sleep(0.3)  # let every request arrive and queue
        depth_at_wake.append(router.fleet.queue_depth("cold"))
        backend = await asyncio.to_thread(spawn_backend, "cold-0")
        source.add("cold", backend.replica_id, backend.url)

    async with running_router(source, wake=InProcessWakeSignal(wake)) as router, aiohttp.ClientSession() as session:
        bodies = [{"model": "cold", "prompt": f"request {i}"} for i in range(20)]
        results = await asyncio.gather(*(post(session, router.url, b) for b in bodies))
        assert [status for status, _, _ in results] == [200] * 20
        assert wakes == [("ns1", "cold")]  # signalled once, at once
        assert depth_at_wake == [20]
        assert router.fleet.queue_depth("cold") == 0
        async with session.get(router.url + "/metrics") as resp:
            assert 'kvfleet_router_queue_depth{model="cold",namespace="ns1"} 0.0' in await resp.text()


async def test_activator_queue_bounds_429_and_503() -> None:
    source = StaticReplicaSource()
    source.set_deployment("empty", routing=RoutingSpec(max_queue=2, max_queue_wait_seconds=0.5))
    async with running_router(source, retry_after_s=7) as router, aiohttp.ClientSession() as session:
        held = [asyncio.create_task(post(session, router.url, {"model": "empty", "prompt": "x"})) for _ in range(2)]
        await until(lambda: router.fleet.queue_depth("empty") == 2)
        status, headers, raw = await post(session, router.url, {"model": "empty", "prompt": "x"})
        assert status == 429 and headers["Retry-After"] == "7"
        assert "maxQueue 2" in json.loads(raw)["error"]["message"]
        for status, headers, raw in await asyncio.gather(*held):
            assert status == 503 and headers["Retry-After"] == "7"
            assert "maxQueueWaitSeconds" in json.loads(raw)["error"]["message"]


async def test_the_router_wide_hold_budget_bounds_every_tenants_queue_together() -> None:
    # Two tenants each allow 100 held requests; the router holds 3 in all, whoever asks.
    source = StaticReplicaSource()
    for name in ("a", "b"):
        source.set_deployment(name, routing=RoutingSpec(max_queue=100, max_queue_wait_seconds=0.5))
    async with running_router(source, max_held_requests=3) as router, aiohttp.ClientSession() as session:
        held = [asyncio.create_task(post(session, router.url, {"model": m, "prompt": "x"})) for m in "aab"]
        await until(lambda: router.fleet.queue_depth("a") + router.fleet.queue_depth("b") == 3)
        status, _, raw = await post(session, router.url, {"model": "b", "prompt": "x"})
        assert status == 429
        assert "max_held_requests, is 3" in json.loads(raw)["error"]["message"]
        async with session.get(router.url + "/metrics") as resp:
            text = await resp.text()
        assert "kvfleet_router_held_requests 3.0" in text and "kvfleet_router_held_requests_limit 3.0" in text
        assert "kvfleet_router_hold_budget_refusals_total 1.0" in text
        assert [status for status, _, _ in await asyncio.gather(*held)] == [503] * 3
        # Timed-out waiters gave their places back.
        async with session.get(router.url + "/metrics") as resp:
            assert "kvfleet_router_held_requests 0.0" in await resp.text()


async def test_killed_replica_requests_are_retried_elsewhere_and_none_is_lost(
    spawn_backend: Callable[[str], Backend],
) -> None:
    victim, survivor = spawn_backend("victim"), spawn_backend("survivor")
    source = source_for("kill", [victim, survivor], RoutingSpec(strategy="round-robin"))
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        bodies = [{"model": "kill", "prompt": f"p{i}", "kvfleet_test": {"hold_s": 1.0}} for i in range(20)]
        tasks = [asyncio.create_task(post(session, router.url, b)) for b in bodies]
        await until(lambda: sum(router.fleet.inflight("kill").values()) == 20)
        assert router.fleet.inflight("kill")["victim"] == 10
        assert router.fleet.waiting("kill") == {"victim": 10, "survivor": 10}  # none answered yet
        victim.kill()  # SIGKILL with 10 requests accepted and not yet answered
        # Requests arriving after the kill find the dead replica still listed: refused, retried.
        late = [asyncio.create_task(post(session, router.url, b)) for b in bodies[:6]]
        results = await asyncio.gather(*tasks, *late)
        assert [status for status, _, _ in results] == [200] * 26
        assert all(h["X-Kvfleet-Replica"] == "survivor" for _, h, _ in results[20:])
        async with session.get(router.url + "/metrics") as resp:
            text = await resp.text()
        retries = next(
            line
            for line in text.splitlines()
            if line.startswith('kvfleet_router_retries_total{model="kill",namespace="default"}')
        )
        assert float(retries.split()[-1]) >= 10
        # Failed attempts, retries and answers each left their counts where they found them.
        assert router.fleet.inflight("kill") == router.fleet.waiting("kill") == {"victim": 0, "survivor": 0}


async def test_draining_replica_gets_nothing_new_and_finishes_in_flight(
    spawn_backend: Callable[[str], Backend],
) -> None:
    old, new = spawn_backend("old"), spawn_backend("new")
    source = source_for("drain", [old])
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        long = [
            asyncio.create_task(
                post(session, router.url, {"model": "drain", "prompt": f"l{i}", "kvfleet_test": {"hold_s": 1.0}})
            )
            for i in range(3)
        ]
        await until(lambda: router.fleet.inflight("drain").get("old", 0) == 3)
        source.add("drain", new.replica_id, new.url)
        source.mark_draining("drain", "old")
        fresh = await asyncio.gather(
            *(post(session, router.url, {"model": "drain", "prompt": f"n{i}"}) for i in range(10))
        )
        assert {h["X-Kvfleet-Replica"] for _, h, _ in fresh} == {"new"}
        finished = await asyncio.gather(*long)
        assert [(s, h["X-Kvfleet-Replica"]) for s, h, _ in finished] == [(200, "old")] * 3
        assert old.stats()["completed"] == 3


async def test_503_from_a_draining_engine_is_retried_on_another(spawn_backend: Callable[[str], Backend]) -> None:
    a, b = spawn_backend("a"), spawn_backend("b")
    async with aiohttp.ClientSession() as session:
        async with session.post(a.url + "/admin/drain"):
            pass
        source = source_for("d503", [a, b], RoutingSpec(strategy="round-robin"))
        async with running_router(source) as router:
            results = await asyncio.gather(
                *(post(session, router.url, {"model": "d503", "prompt": "x"}) for _ in range(6))
            )
    assert [(s, h["X-Kvfleet-Replica"]) for s, h, _ in results] == [(200, "b")] * 6


async def test_broken_stream_ends_with_an_error_event(backends: list[Backend]) -> None:
    """With migration off (tests/router/test_stream_migration.py has it on), a broken stream ends
    with an error event and [DONE]."""
    source = source_for("broken", backends[:1])
    body = {"model": "broken", "prompt": "x", "stream": True, "kvfleet_test": {"chunks": 5, "break_after": 2}}
    async with (
        running_router(source, stream_migration_attempts=0) as router,
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        raw = await resp.read()
    events = [e for e in raw.decode().split("\n\n") if e]
    assert len(events) == 4 and events[3] == "data: [DONE]", raw
    assert [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:2]] == ["w0", "w1"]
    error = json.loads(events[2].removeprefix("data: "))["error"]
    assert error["type"] == "upstream_disconnected" and "failed mid-stream" in error["message"]
    assert b"partial" not in raw  # the half-written event was dropped, not glued to ours


async def test_client_disconnect_cancels_the_upstream_request(spawn_backend: Callable[[str], Backend]) -> None:
    backend = spawn_backend("slow")
    source = source_for("gone", [backend])
    body = {"model": "gone", "prompt": "x", "stream": True, "kvfleet_test": {"chunks": 200, "delay_s": 0.05}}
    async with running_router(source) as router:
        async with aiohttp.ClientSession() as session, session.post(router.url + "/v1/completions", json=body) as resp:
            await resp.content.readany()
            resp.close()  # the client walks away mid-stream
        for _ in range(100):
            stats = backend.stats()
            if stats["cancelled"] == 1:
                break
            await asyncio.sleep(0.05)
        assert stats["cancelled"] == 1 and stats["completed"] == 0 and stats["active"] == 0
        await until(lambda: sum(router.fleet.inflight("gone").values()) == 0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_metrics_after_traffic(backends: list[Backend], path: str) -> None:
    source = source_for("metered", backends[:2])
    body: dict[str, Any] = {"model": "metered", "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    else:
        body["prompt"] = SYSTEM
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        for _ in range(3):
            status, _, _ = await post(session, router.url, body, path)
            assert status == 200
        async with session.get(router.url + "/metrics") as resp:
            text = await resp.text()
    assert 'kvfleet_router_requests_total{code="200",model="metered",namespace="default"} 3.0' in text
    assert 'kvfleet_router_ttft_seconds_count{model="metered",namespace="default"} 3.0' in text
    assert 'kvfleet_router_prefix_match_ratio_count{model="metered",namespace="default"} 3.0' in text
    # The second and third requests were believed fully cached on the replica the first one used.
    assert 'kvfleet_router_prefix_match_ratio_bucket{le="0.99",model="metered",namespace="default"} 1.0' in text
    assert 'kvfleet_router_inflight{model="metered",namespace="default",replica="r0"} 0.0' in text
    assert 'kvfleet_router_awaiting_first_byte{model="metered",namespace="default",replica="r0"} 0.0' in text
    assert 'kvfleet_router_queue_depth{model="metered",namespace="default"} 0.0' in text


async def test_silent_replica_times_out_with_504_and_is_not_retried(spawn_backend: Callable[[str], Backend]) -> None:
    a, b = spawn_backend("silent-a"), spawn_backend("silent-b")
    source = source_for("silent", [a, b], RoutingSpec(strategy="round-robin"))
    body = {"model": "silent", "prompt": "x", "kvfleet_test": {"hold_s": 3}}
    async with running_router(source, idle_read_timeout_s=0.5) as router, aiohttp.ClientSession() as session:
        status, _, raw = await post(session, router.url, body)
    assert status == 504
    assert "no response headers in time" in json.loads(raw)["error"]["message"]
    # The replica may still be generating: sending it to the other one too would double the work.
    assert a.stats()["requests"] + b.stats()["requests"] == 1


async def test_replica_headers_pass_through_except_hop_by_hop_ones() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    int(v)
                    for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                    if k.lower() == b"content-length"
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                    b"Connection: keep-alive\r\nKeep-Alive: timeout=5\r\nX-Request-Id: abc-1\r\n"
                    b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\n\r\n{}"
                )
                await writer.drain()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    source = StaticReplicaSource()
    source.set_deployment("raw", routing=RoutingSpec())
    source.add("raw", "r0", f"http://127.0.0.1:{port}")
    try:
        async with running_router(source) as router:
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            body = b'{"model":"raw"}'
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            writer.close()
    finally:
        server.close()
        await server.wait_closed()
    lines = head.split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK"
    names = [line.split(":", 1)[0].lower() for line in lines[1:] if line]
    assert "x-request-id: abc-1" in head.lower() and names.count("set-cookie") == 2
    assert names.count("content-length") == 1 and "keep-alive" not in names
    assert "x-kvfleet-replica: r0" in head.lower()


# vLLM 0.32.0's own 400 (its ErrorResponse: the exception's class name as ``type``, the HTTP status as
# an integer ``code``), as it answered in tests/vllm.
VLLM_400 = {
    "message": "This model's maximum context length is 512 tokens. However, your request has 600 input tokens.",
    "type": "BadRequestError",
    "param": "prompt",
    "code": 400,
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_an_engines_error_reaches_the_client_in_openai_shape(backends: list[Backend], stream: bool) -> None:
    source = source_for("errs", backends[:1])
    body = {"model": "errs", "prompt": "x", "stream": stream, "kvfleet_test": {"status": 400, "error": VLLM_400}}
    already = {"message": "no", "type": "invalid_request_error", "param": None, "code": "bad_thing"}
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        async with session.post(f"{router.url}/v1/completions", json=body) as resp:
            assert resp.status == 400 and resp.content_type == "application/json"
            error = (await resp.json())["error"]
        ok = {**body, "kvfleet_test": {"status": 422, "error": already}}
        async with session.post(f"{router.url}/v1/completions", json=ok) as resp:
            assert resp.status == 422
            untouched = (await resp.json())["error"]
    # OpenAI's schema: type a snake_case class, code a string or null; message and param kept.
    assert error == {
        "message": VLLM_400["message"],
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    assert untouched == already  # OpenAI's shape already: passed on as it came
