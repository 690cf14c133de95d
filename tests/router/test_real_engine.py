"""The router in front of real reference-engine processes (kvfleet engine serve, a tiny random model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.spec import RoutingSpec
from kvfleet_testkit.engines import Engine

from .conftest import running_engines, running_router

SERVED = "tiny-chat"
SYSTEM = "You are the support assistant of a hardware shop. Always answer in two short sentences. " * 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, vocab=1024)
    logs = tmp_path_factory.mktemp("logs")
    with running_engines(model, 2, logs, SERVED, "--kv-blocks", "256", "--block-size", "16") as engines:
        yield engines


def chat(question: str, **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": SERVED, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> tuple[str, list[str]]:
    async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    text = "".join(
        choice["delta"].get("content") or "" for e in events[:-1] for choice in json.loads(e).get("choices", [])
    )
    return text, events


@pytest.mark.slow
async def test_shared_prefix_sticks_to_one_engine_and_hits_its_prefix_cache(engines: list[Engine]) -> None:
    source = StaticReplicaSource()
    source.set_deployment(SERVED, routing=RoutingSpec(prefix_block_chars=64))
    for engine in engines:
        source.add(SERVED, engine.replica_id, engine.url, kv_capacity_blocks=256 * 16 // 64)
    before = {e.replica_id: e.metrics() for e in engines}
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        served_by = []
        for i in range(6):
            async with session.post(router.url + "/v1/chat/completions", json=chat(f"Question {i}?")) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["object"] == "chat.completion"
                served_by.append(resp.headers["X-Kvfleet-Replica"])
        assert len(set(served_by)) == 1, served_by
        sticky = next(e for e in engines if e.replica_id == served_by[0])
        other = next(e for e in engines if e is not sticky)
        after = sticky.metrics()
        hits = after["vllm:prefix_cache_hits_total"] - before[sticky.replica_id]["vllm:prefix_cache_hits_total"]
        queries = (
            after["vllm:prefix_cache_queries_total"] - before[sticky.replica_id]["vllm:prefix_cache_queries_total"]
        )
        assert hits / queries > 0.6  # five of six prompts reuse the system prompt's blocks
        untouched = other.metrics()["vllm:prefix_cache_queries_total"]
        assert untouched == before[other.replica_id]["vllm:prefix_cache_queries_total"]

        # Streaming through the router gives the same greedy text as straight from the engine.
        via_router, events = await stream_text(session, router.url, chat("Streaming?"))
        direct, _ = await stream_text(session, sticky.url, chat("Streaming?"))
        assert via_router == direct and len(events) >= 3


@pytest.mark.slow
async def test_sigterm_on_an_engine_loses_no_request(engines: list[Engine], tmp_path: Path) -> None:
    """The engine that would get the request drains and exits; its refusals are retried on the other."""
    victim, survivor = engines
    source = StaticReplicaSource()
    source.set_deployment(SERVED, routing=RoutingSpec(strategy="round-robin"))
    for engine in engines:
        source.add(SERVED, engine.replica_id, engine.url)
    async with running_router(source) as router, aiohttp.ClientSession() as session:
        victim.stop()  # SIGTERM: drain (503) and exit; the router has not been told
        for i in range(6):
            async with session.post(router.url + "/v1/chat/completions", json=chat(f"after {i}")) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Kvfleet-Replica"] == survivor.replica_id
