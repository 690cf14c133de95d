"""Two real reference engines publishing KV-cache events and a real router subscribed to both: a prompt
another router (here: a client going straight to an engine) cached is found by its events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import click
import pytest

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.tokenizer import ModelTokenizer
from kvfleet.router.cli import parse_replicas
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.spec import RoutingSpec
from kvfleet_testkit.engines import Engine, start_engine

from .conftest import pick_free_port, running_router, until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, vocab=1024)


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[Engine, int]]]:
    logs = tmp_path_factory.mktemp("logs")
    started: list[tuple[Engine, int]] = []
    try:
        for i in range(2):
            port = pick_free_port()
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
            engine = start_engine(
                model_dir, f"e{i}", logs, "tiny", "--kv-blocks", "256", "--kv-events-config", json.dumps(config)
            )
            started.append((engine, port))
        yield started
    finally:
        for engine, _ in started:
            engine.stop()


async def test_router_finds_what_an_engine_cached_through_its_events(
    engines: list[tuple[Engine, int]], model_dir: Path
) -> None:
    source = StaticReplicaSource()
    source.set_deployment("tiny", routing=RoutingSpec(prefix_block_chars=64))
    for engine, port in engines:
        source.add("tiny", engine.replica_id, engine.url, kv_events_port=port)
    async with (
        running_router(
            source,
            kv_events_port=5557,
            kv_events_tokenizers={"tiny": str(model_dir)},
            kv_events_inline_tokenize_bytes=0,  # every prompt tokenized in a worker thread, as large ones are
            placement=False,
        ) as router,
        aiohttp.ClientSession() as session,
    ):
        caches = router.fleet.engine_caches("tiny")
        assert caches is not None

        async def complete(url: str, prompt: str) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()

        # Both engines publish once they cache something; until then each is scored by the index.
        for engine, _ in engines:
            await complete(engine.url, f"warm up {engine.replica_id} " * 8)
        await until(lambda: caches.usable_count() == 2, timeout_s=15)
        # A long document sent straight to each engine: this router never saw either.
        documents = [f"document {i}: the text many questions are asked about, " * 20 for i in range(2)]
        for (engine, _), document in zip(engines, documents, strict=True):
            await complete(engine.url, document)
        await until(lambda: caches.blocks() > 40, timeout_s=15)
        before = [engine.metrics().get("vllm:prefix_cache_hits_total", 0.0) for engine, _ in engines]
        for n in range(3):
            for document in documents:
                await complete(router.url, document + f" question {n}?")
        after = [engine.metrics().get("vllm:prefix_cache_hits_total", 0.0) for engine, _ in engines]
        # Every question went where its document is cached and hit it there: ~3 documents' worth of
        # hits per engine. An index alone sends each document's first question where the load says (a
        # miss wherever it lands) and the next two after it: ~2 documents' worth.
        doc_tokens = len(ModelTokenizer.from_dir(model_dir).encode(documents[0]))
        hits = [a - b for a, b in zip(after, before, strict=True)]
        assert all(h > 2.5 * doc_tokens for h in hits), (hits, doc_tokens)
        async with session.get(router.url + "/metrics") as resp:
            text = await resp.text()
        assert 'kvfleet_router_kv_event_subscriptions_usable{model="tiny",namespace="default"} 2.0' in text


def test_replica_flag_takes_an_events_port() -> None:
    source = parse_replicas(("tiny=http://10.0.0.1:8000,kv-events-port=5557", "tiny=http://10.0.0.2:8000"), "prefix")
    endpoints = source.snapshot()["default/tiny"].endpoints
    assert [e.kv_events_port for e in endpoints] == [5557, None]
    with pytest.raises(click.BadParameter, match="kv-events-port must be a port number"):
        parse_replicas(("tiny=http://10.0.0.1:8000,kv-events-port=x",), "prefix")
    with pytest.raises(click.BadParameter, match="kv_events_port must be in"):
        parse_replicas(("tiny=http://10.0.0.1:8000,kv-events-port=70000",), "prefix")
