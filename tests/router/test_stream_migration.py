"""Stream migration with real reference-engine processes: a replica killed (SIGKILL) mid-stream, and
the client still gets one complete stream with one id, one usage and ``[DONE]``."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.spec import RoutingSpec
from kvfleet_testkit.engines import Engine

from .conftest import running_engines, running_router

SERVED = "tiny-chat"
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Words only: the model's output re-tokenizes into the tokens it generated (as a real model's
    # text nearly always does), so a continuation from the text must match the unbroken run exactly.
    # How often a byte-level model's continuations differ is measured in bench/chaos.py.
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, vocab=1024, words_only=True)


@pytest.fixture
def engines(model_dir: Path, tmp_path: Path) -> Iterator[list[Engine]]:
    with running_engines(model_dir, 2, tmp_path, SERVED, "--kv-blocks", "256", prefix="m") as engines:
        yield engines


def source_of(engines: list[Engine]) -> StaticReplicaSource:
    source = StaticReplicaSource()
    source.set_deployment(SERVED, routing=RoutingSpec(strategy="round-robin"))
    for engine in engines:
        source.add(SERVED, engine.replica_id, engine.url)
    return source


def request(path: str, n: int) -> dict[str, Any]:
    common = {"model": SERVED, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    common["stream_options"] = {"include_usage": True}
    if path == "/v1/chat/completions":
        return {**common, "messages": [{"role": "user", "content": f"Tell me about routers, take {n}."}]}
    return {**common, "prompt": f"The router sends each request, take {n},"}


def events_of(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for event in raw.decode().split("\n\n"):
        if event.strip():
            assert event.startswith("data: "), event
            payload = event.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def text_of(events: list[Any], chat: bool) -> str:
    parts = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices", []):
                parts.append((choice.get("delta", {}).get("content") if chat else choice.get("text")) or "")
    return "".join(parts)


async def stream(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], kill_after: int, engines: list[Engine]
) -> tuple[list[Any], str]:
    """Stream ``body``; after ``kill_after`` events SIGKILL the replica serving it (0: never)."""
    async with session.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        replica = resp.headers.get("X-Kvfleet-Replica", "")
        raw = b""
        seen = 0
        async for chunk in resp.content.iter_any():
            raw += chunk
            seen = raw.count(b"\n\n")
            if kill_after and seen >= kill_after:
                victim = next(e for e in engines if e.replica_id == replica)
                victim.proc.send_signal(signal.SIGKILL)
                kill_after = 0
    return events_of(raw), replica


def check_well_formed(events: list[Any], chat: bool) -> dict[str, Any]:
    """One id and created throughout, one role chunk, one finish, one usage, ``[DONE]`` last."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("error" not in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert all(ch["index"] == 0 for c in chunks for ch in c["choices"])
    if chat:
        roles = [c for c in chunks for ch in c["choices"] if "role" in ch["delta"]]
        assert len(roles) == 1
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usages) == 1
    return dict(usages[0])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_replica_killed_mid_stream_is_continued_on_another(engines: list[Engine], path: str) -> None:
    chat = path.endswith("chat/completions")
    async with running_router(source_of(engines)) as router, aiohttp.ClientSession() as session:
        unbroken, _ = await stream(session, router.url, path, request(path, 1), 0, engines)
        reference_usage = check_well_formed(unbroken, chat)
        broken, victim = await stream(session, router.url, path, request(path, 1), 40, engines)
        usage = check_well_formed(broken, chat)
        metrics = router.metrics.render().decode()
    series = f'kvfleet_router_stream_migrations_total{{model="{SERVED}",namespace="default",result="continued"}}'
    assert f"{series} 1.0" in metrics
    full, migrated = text_of(unbroken, chat), text_of(broken, chat)
    # The tokens the client got add up to what it asked for (one chunk = one token here, see
    # router/migration.py), and the prompt is counted once.
    assert usage["completion_tokens"] == reference_usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == reference_usage["prompt_tokens"]
    # Temperature 0 and a text that re-tokenizes into the generated tokens: the migrated stream's
    # text is the unbroken run's, the part before the break and the continuation alike.
    assert migrated == full
    assert len(full.split()) >= MAX_TOKENS // 2, "a real text, not a few repeated characters"
    assert victim in {e.replica_id for e in engines}


@pytest.mark.slow
async def test_a_stream_that_cannot_be_continued_ends_with_an_error_event_and_done(engines: list[Engine]) -> None:
    only = engines[:1]
    path = "/v1/chat/completions"
    async with running_router(source_of(only), stream_migration_attempts=2) as router, aiohttp.ClientSession() as s:
        events, _ = await stream(s, router.url, path, request(path, 2), 20, only)
        metrics = router.metrics.render().decode()
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "upstream_disconnected" and "2 continuation attempts failed" in error["message"]
    exhausted = 'result="attempts_exhausted"'
    assert f'kvfleet_router_stream_migrations_total{{model="{SERVED}",namespace="default",{exhausted}}} 1.0' in metrics
