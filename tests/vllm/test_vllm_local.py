"""kvfleet's vLLM contracts against running vLLM: local mode runs two replicas of vLLM's CPU build
with the launcher's own command (``render_vllm``), KV-cache events on, behind the real router, with
a real Prometheus (Debian) scraping them.

One module-scoped fleet serves every test (two vLLM starts per run of this module); routers started
in the tests over the same replicas play a restarted router and the round-robin baseline, and two
reference engines (seconds to start) give the prefix-hit margin to match. Destructive tests
(SIGTERM, kill -9) come last, in file order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from kvfleet.autoscaler.promql import deployment_queries
from kvfleet.local.models import VLLM_TINY_MODEL
from kvfleet.local.runtime import LocalRuntime, load_manifests
from kvfleet.local.settings import LocalSettings, ProcessSettings
from kvfleet.router.prompt_tokens import engine_block_hashes, load_tokenizer
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec
from tests.support.sse import DONE, data_events

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.asyncio(loop_scope="module")]

NAME = "tiny-vllm"
SERVED = "tiny-vllm"
# vLLM's CPU attention works in blocks that are multiples of 32 tokens (its default is 128).
BLOCK_SIZE = 32
# Room for streams long enough that a kill or SIGTERM lands mid-stream: this tiny model makes
# ~250 tokens a second here.
MAX_MODEL_LEN = 2048
# Each vLLM start on 2 busy cores: imports of three interpreters, model load, warm-up.
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120)
DOCUMENT = "kvfleet routes each request to the replica that already holds its prefix. " * 6


@dataclass
class Fleet:
    runtime: LocalRuntime
    model: Path
    start_s: float

    @property
    def url(self) -> str:
        return self.runtime.router.url

    def replicas(self) -> list[Any]:
        return [r for r in self.runtime.runs[NAME].processes.replicas.values() if r.state == "ready"]


def manifest(model: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": f"file://{model}", "servedName": SERVED},
            "engine": {
                "kind": "vllm",
                "maxModelLen": MAX_MODEL_LEN,
                "dtype": "float32",
                # No torch.compile warm-up (minutes of C++ on 2 cores); small batches for 2 cores.
                "extraArgs": ["--enforce-eager", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8"],
            },
            # gpus 0: vLLM's CPU build; the KV cache is a quarter of the memory (512 MiB).
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
            "replicas": 2,
            "routing": {"strategy": "prefix", "maxQueueWaitSeconds": 120},
        },
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(vllm_installed: None, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    from kvfleet.engine.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("vllm-fleet")
    # Whole words only: a migrated stream's text re-tokenizes into the tokens vLLM generated, so the
    # continuation's prompt is exactly the original's plus what was sent.
    model = make_tiny_model(root / "model", words_only=True, **VLLM_TINY_MODEL)
    (root / "m.yaml").write_text(yaml.safe_dump(manifest(model)))
    settings = LocalSettings(
        router_port=0,
        status_port=0,
        state_dir=root / "state",
        tick_s=0.5,
        with_prometheus=True,
        prometheus_scrape_interval_s=1.0,
        processes=ProcessSettings(ready_timeout_s=START_TIMEOUT_S, drain_wait_s=60, term_grace_s=60),
    )
    # The engines start from this folder, never from a checkout's root (its operator/ folder).
    runtime = LocalRuntime(load_manifests([root / "m.yaml"]), settings, cwd=root)
    started = time.monotonic()
    await runtime.start()
    try:
        processes = runtime.runs[NAME].processes
        while processes.count("ready") < 2:
            assert time.monotonic() - started < START_TIMEOUT_S, f"vLLM replicas not ready: {list(processes.events)}"
            await asyncio.sleep(0.5)
        start_s = time.monotonic() - started
        print(f"two vLLM replicas ready in {start_s:.1f} s")  # the cost this module adds, in the test log
        yield Fleet(runtime=runtime, model=model, start_s=start_s)
    finally:
        await runtime.stop(force=None)
        runtime.kill_all()


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with session.post(url, json=body, timeout=REQUEST_TIMEOUT) as response:
        return response.status, await response.json(content_type=None)


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, bool]:
    """The streamed completion's text and whether the stream ended with ``[DONE]``."""
    text, done = "", False
    async with session.post(url, json={**body, "stream": True}, timeout=REQUEST_TIMEOUT) as response:
        assert response.status == 200, await response.text()
        async for event in data_events(response):
            if event == DONE:
                done = True
                continue
            assert isinstance(event, dict) and "error" not in event, event
            for choice in event["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, done


# -- serving through the launcher's command and local mode ---------------------------------------


async def test_vllm_serves_completions_and_chat_through_the_router(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{fleet.url}/v1/models") as response:
            assert response.status == 200
            assert SERVED in {m["id"] for m in (await response.json())["data"]}
        status, body = await post(
            session, f"{fleet.url}/v1/completions", {"model": SERVED, "prompt": "Hello", "max_tokens": 5}
        )
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["text"]
        chat = {"model": SERVED, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}
        status, body = await post(session, f"{fleet.url}/v1/chat/completions", chat)
        assert status == 200, body
        assert body["choices"][0]["message"]["role"] == "assistant"
        text, done = await stream_text(
            session, f"{fleet.url}/v1/completions", {"model": SERVED, "prompt": "Stream", "max_tokens": 6}
        )
        assert done and text


# -- errors: vLLM's own 400s reach the client in OpenAI's shape -----------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        # Longer than maxModelLen: vLLM's own check (the router cannot know the token count exactly).
        ({"prompt": "word " * (MAX_MODEL_LEN + 50), "max_tokens": 4}, "context length"),
        ({"prompt": "Hello", "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"prompt": "Hello", "max_tokens": 4, "top_p": 2.0}, "top_p"),
    ],
    ids=["too-long", "negative-temperature", "top-p-over-1"],
)
async def test_vllm_400s_reach_the_client_in_openai_shape(fleet: Fleet, body: dict[str, Any], says: str) -> None:
    async with aiohttp.ClientSession() as session:
        status, answer = await post(session, f"{fleet.url}/v1/completions", {"model": SERVED, **body})
    assert status == 400, answer
    error = answer["error"]
    assert isinstance(error, dict), answer
    assert says in error["message"].lower().replace("_", " ").replace("top p", "top_p"), answer
    # OpenAI's error schema (vLLM wrote type "BadRequestError" and code 400): the router reshapes it.
    assert set(error) == {"message", "type", "param", "code"}, answer
    assert error["type"] == "invalid_request_error", answer
    assert error["code"] == ("context_length_exceeded" if says == "context length" else None), answer
    assert error["param"] is None or isinstance(error["param"], str), answer


# -- KV-cache events: the router's token blocks are vLLM's -----------------------------------------


async def _router_holds(fleet: Fleet, body: dict[str, Any], path: str) -> tuple[int, int]:
    """Send ``body`` until one replica's view (from vLLM's BlockStored events) holds every block the
    router hashes for it; returns (blocks the router hashed, blocks the best view holds)."""
    caches = fleet.runtime.router.fleet.engine_caches(SERVED)
    tokenizer = load_tokenizer(fleet.model)
    hashes = engine_block_hashes(tokenizer, body, BLOCK_SIZE)
    assert hashes, "the prompt must span whole blocks"
    held = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            status, answer = await post(session, f"{fleet.url}{path}", body)
            assert status == 200, answer
            assert caches is not None
            held = max(
                (state.view.matched_blocks(hashes) for r in caches.replica_ids() if (state := caches.get(r))),
                default=0,
            )
            if held == len(hashes):
                break
            await asyncio.sleep(0.5)
    return len(hashes), held


async def _kv_event_metrics(fleet: Fleet) -> list[str]:
    async with aiohttp.ClientSession() as session, session.get(f"{fleet.url}/metrics") as response:
        return [line for line in (await response.text()).splitlines() if "kv_event" in line and SERVED in line]


async def test_router_blocks_equal_vllms_for_completions(fleet: Fleet) -> None:
    # A view is used once a batch arrived since its subscription connected: the requests bring them.
    body = {"model": SERVED, "prompt": "completions: " + DOCUMENT, "max_tokens": 2}
    hashed, held = await _router_holds(fleet, body, "/v1/completions")
    assert held == hashed, f"vLLM stored {held} of the router's {hashed} blocks: {await _kv_event_metrics(fleet)}"
    caches = fleet.runtime.router.fleet.engine_caches(SERVED)
    assert caches is not None and caches.block_size() == BLOCK_SIZE


async def test_router_blocks_equal_vllms_for_chat(fleet: Fleet) -> None:
    # The chat template as vLLM renders it: the router renders tokenizer_config.json's template too.
    body = {
        "model": SERVED,
        "messages": [
            {"role": "system", "content": "chat: " + DOCUMENT},
            {"role": "user", "content": "What does the router do?"},
        ],
        "max_tokens": 2,
    }
    hashed, held = await _router_holds(fleet, body, "/v1/chat/completions")
    assert held == hashed, f"vLLM stored {held} of the router's {hashed} blocks"


# -- KV-cache events: replay after a router restart, hits reported, the prefix-hit margin ----------


def _router_settings(model: Path, **overrides: Any) -> RouterSettings:
    """One router's settings for every router these tests start (each replica names its own events port)."""
    return RouterSettings(
        port=0,
        kv_events_port=1,  # overridden per replica; required with tokenizers
        kv_events_tokenizers={SERVED: str(model)},
        kv_events_reconnect_s=0.05,
        kv_events_reconnect_max_s=0.5,
        placement=False,
        **overrides,
    )


@asynccontextmanager
async def _router_over(
    replicas: list[tuple[str, str, int | None]], settings: RouterSettings, strategy: str
) -> AsyncIterator[RouterServer]:
    """A router started now over already serving replicas ``(id, url, events port)``: a restarted router."""
    source = StaticReplicaSource()
    source.set_deployment(SERVED, routing=RoutingSpec(strategy=strategy))
    for replica_id, url, events_port in replicas:
        source.add(SERVED, replica_id, url, kv_events_port=events_port if strategy == "prefix" else None)
    server = RouterServer(settings, source, NoWakeSignal())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def _vllm_replicas(fleet: Fleet) -> list[tuple[str, str, int | None]]:
    return [(r.replica_id, r.url, r.kv_events_port) for r in fleet.replicas()]


async def _metric_lines(session: aiohttp.ClientSession, url: str, prefix: str) -> list[str]:
    async with session.get(f"{url}/metrics", timeout=REQUEST_TIMEOUT) as response:
        return [line for line in (await response.text()).splitlines() if line.startswith(prefix)]


async def _replayed(session: aiohttp.ClientSession, router: RouterServer, replicas: int) -> bool:
    """Each replica's replay socket answered this router (a replay ended ``done``)."""
    lines = await _metric_lines(session, router.url, "kvfleet_router_kv_event_replays_total")
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'outcome="done"' in line) >= replicas


async def _until(check: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value if isinstance(value, bool) else await value:
            return
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


def _best_held(router: RouterServer, hashes: list[int]) -> int:
    caches = router.fleet.engine_caches(SERVED)
    if caches is None:
        return 0
    return max((st.view.matched_blocks(hashes) for r in caches.replica_ids() if (st := caches.get(r))), default=0)


async def test_a_restarted_router_rebuilds_its_view_from_vllms_replay(fleet: Fleet) -> None:
    """vLLM's replay socket: a router that starts after the blocks were stored holds them at once,
    without a request (its subscriptions ask from batch 0)."""
    body = {"model": SERVED, "prompt": "replay: " + DOCUMENT, "max_tokens": 2}
    hashes = engine_block_hashes(load_tokenizer(fleet.model), body, BLOCK_SIZE)
    async with aiohttp.ClientSession() as session:
        status, answer = await post(session, f"{fleet.url}/v1/completions", body)  # stored in one replica
        assert status == 200, answer
        await _until(lambda: _best_held(fleet.runtime.router, hashes) == len(hashes), "the first router's view")
        settings = _router_settings(fleet.model)
        async with _router_over(_vllm_replicas(fleet), settings, "prefix") as router:
            await _until(lambda: _replayed(session, router, 2), "a replay from each vLLM replica")
            assert _best_held(router, hashes) == len(hashes), "the replay rebuilt the stored prefix"


async def test_vllm_reports_the_blocks_a_request_hits(fleet: Fleet) -> None:
    """kv_cache_report_mode "full": a router without replay learns a prefix stored before it subscribed
    from the hit announcement of the next request on it (vLLM stores nothing new for it)."""
    replica = fleet.replicas()[0]
    body = {"model": SERVED, "prompt": "hits: " + DOCUMENT, "max_tokens": 1}
    hashes = engine_block_hashes(load_tokenizer(fleet.model), body, BLOCK_SIZE)
    async with aiohttp.ClientSession() as session:
        status, answer = await post(session, f"{replica.url}/v1/completions", body)  # stored before
        assert status == 200, answer
        settings = _router_settings(fleet.model, kv_events_replay=False)
        async with _router_over(_vllm_replicas(fleet), settings, "prefix") as router:
            reported = {**body, "vllm_xargs": {"kv_cache_report_mode": "full"}}
            for _ in range(30):  # until the subscription is connected (ZeroMQ drops what came before)
                status, answer = await post(session, f"{replica.url}/v1/completions", reported)
                assert status == 200, answer
                await asyncio.sleep(0.3)
                if _best_held(router, hashes) == len(hashes):
                    break
            assert _best_held(router, hashes) == len(hashes), "vLLM announced the hit blocks"


def _trace(tag: str, groups: int = 3, per_group: int = 4) -> list[str]:
    """A shared-prefix workload: ``groups`` documents, each asked ``per_group`` questions, interleaved
    (an odd number of groups, so round-robin over two replicas splits every group)."""
    return [
        f"{tag} document {g}: {DOCUMENT} Question {i} about document {g}?"
        for i in range(per_group)
        for g in range(groups)
    ]


async def _prefix_hit_ratio(
    session: aiohttp.ClientSession, router: RouterServer, replica_urls: list[str], tag: str
) -> float:
    """The replicas' own ``prefix_cache_hits / prefix_cache_queries`` over the trace sent through ``router``."""

    async def totals() -> tuple[float, float]:
        hits = queries = 0.0
        for url in replica_urls:
            for line in await _metric_lines(session, url, "vllm:prefix_cache_"):
                name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
                hits += value if name == "vllm:prefix_cache_hits_total" else 0.0
                queries += value if name == "vllm:prefix_cache_queries_total" else 0.0
        return hits, queries

    hits0, queries0 = await totals()
    for prompt in _trace(tag):
        status, answer = await post(
            session, f"{router.url}/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 1}
        )
        assert status == 200, answer
    await asyncio.sleep(1.0)  # the engines' counters follow their last step
    hits1, queries1 = await totals()
    assert queries1 > queries0, "no prefix-cache queries counted"
    return (hits1 - hits0) / (queries1 - queries0)


async def _hit_ratios(replicas: list[tuple[str, str, int | None]], model: Path) -> tuple[float, float]:
    """(KV-aware routing's hit ratio, round-robin's) over the trace. Each engine gets the same two
    traces ("trace 1" for KV-aware, "trace 2" for round-robin: fresh prefixes for each, and prompts
    of the same token count, so the two engines' ratios share their denominators)."""
    urls = [url for _, url, _ in replicas]
    async with aiohttp.ClientSession() as session:
        async with _router_over(replicas, _router_settings(model), "prefix") as router:
            await _until(lambda: _replayed(session, router, len(replicas)), "replays before the trace")
            kv = await _prefix_hit_ratio(session, router, urls, "trace 1")
        async with _router_over(replicas, _router_settings(model), "round-robin") as router:
            rr = await _prefix_hit_ratio(session, router, urls, "trace 2")
    return kv, rr


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference_margin(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> float:
    """The reference engine's margin (KV-aware minus round-robin hit ratio) on the same trace, same
    model, same block size, two replicas."""
    from kvfleet.engine_image.engine_args import kv_events_config
    from kvfleet.free_port import pick_free_port_pair
    from kvfleet_testkit.engines import start_engine

    logs = tmp_path_factory.mktemp("reference")
    engines = []
    try:
        for i in range(2):
            events_port = pick_free_port_pair()
            config = kv_events_config(events_port, "127.0.0.1")
            engine = await asyncio.to_thread(
                start_engine,
                fleet.model,
                f"ref{i}",
                logs,
                SERVED,
                "--block-size",
                str(BLOCK_SIZE),
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--kv-events-config",
                config,
            )
            engines.append((engine, events_port))
        kv, rr = await _hit_ratios([(e.replica_id, e.url, port) for e, port in engines], fleet.model)
    finally:
        for engine, _ in engines:
            engine.stop()
    print(f"reference engine prefix-hit ratio: KV-aware {kv:.3f}, round-robin {rr:.3f}")
    return kv - rr


async def test_kv_aware_routing_beats_round_robin_on_vllms_own_hit_ratio(fleet: Fleet, reference_margin: float) -> None:
    kv, rr = await _hit_ratios(_vllm_replicas(fleet), fleet.model)
    print(f"vLLM prefix-hit ratio: KV-aware {kv:.3f}, round-robin {rr:.3f}; reference margin {reference_margin:.3f}")
    assert reference_margin > 0, "the trace must show a margin on the reference engine"
    # The same blocks hit on both engines give the same margin; 1e-9 absorbs float rounding only.
    assert kv >= rr + reference_margin - 1e-9, (kv, rr, reference_margin)


# -- metrics: what the autoscaler, recording rules, alerts and dashboard read, from a real Prometheus --


def _chart_vllm_selectors() -> dict[str, str]:
    """Every ``vllm:`` selector in the chart's dashboard, recording rules and alerts (with its labels)."""
    import re

    from chart.monitoring import alerts, dashboard_queries, recording_rules, rule_groups

    groups = rule_groups()
    exprs = [q.expr for q in dashboard_queries(model_regex=".+", rate_interval="1m")]
    exprs += list(recording_rules(groups).values()) + list(alerts(groups).values())
    found: dict[str, str] = {}
    for expr in exprs:
        for name, labels in re.findall(r"(vllm:[a-zA-Z0-9_:]+)\s*(\{[^}]*\})?", expr):
            found.setdefault(f"{name}{labels}", expr)
    return found


async def test_every_vllm_metric_kvfleet_reads_has_data_in_prometheus(fleet: Fleet) -> None:
    from prometheus_api_client import PrometheusConnect

    assert fleet.runtime.prometheus is not None
    prom = PrometheusConnect(url=fleet.runtime.prometheus.url, disable_ssl=True)
    async with aiohttp.ClientSession() as session:  # traffic so histograms and counters move
        for i in range(6):
            status, _ = await post(
                session,
                f"{fleet.url}/v1/completions",
                {"model": SERVED, "prompt": f"m{i} " + DOCUMENT, "max_tokens": 3},
            )
            assert status == 200
    # The autoscaler's queries for this deployment (namespace from local mode's scrape labels).
    namespace = fleet.runtime.deployments[0].namespace
    autoscaler = {
        k: q for k, q in deployment_queries(SERVED, namespace, NAME, rate_window="1m").items() if "vllm:" in q
    }
    selectors = {**{f"autoscaler {k}": q for k, q in autoscaler.items()}, **_chart_vllm_selectors()}
    assert len(selectors) >= 8, selectors
    missing: dict[str, str] = dict(selectors)
    deadline = time.monotonic() + 90
    while missing and time.monotonic() < deadline:
        for key in list(missing):
            query = missing[key] if key.startswith("autoscaler ") else key
            if await asyncio.to_thread(prom.custom_query, query):
                del missing[key]
        if missing:
            await asyncio.sleep(2)
    assert not missing, f"no data from real vLLM for: {sorted(missing)}"


# -- drain on SIGTERM, then kill -9 mid-stream (destructive: last) ---------------------------------


async def _stream_counting(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    first: asyncio.Event | None = None,
    answered_by: list[str] | None = None,
) -> tuple[int, bool]:
    """(tokens by the stream's final usage, ended with [DONE]) of one stream; sets ``first`` at its
    first chunk, after putting the router's X-Kvfleet-Replica in ``answered_by``. Not chunks: vLLM
    merges a stream's deltas into one chunk whenever its reader lags (a busy machine), so chunks
    undercount tokens."""
    tokens, done, usages = 0, False, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url, json=body, timeout=REQUEST_TIMEOUT) as response:
        assert response.status == 200, await response.text()
        if answered_by is not None:
            answered_by.append(response.headers.get("X-Kvfleet-Replica", ""))
        async for event in data_events(response):
            if event == DONE:
                done = True
                continue
            assert isinstance(event, dict) and "error" not in event, event
            if event.get("usage"):
                tokens, usages = int(event["usage"]["completion_tokens"]), usages + 1
            if first is not None:
                first.set()
    assert usages <= 1, f"{usages} chunks carried usage: the client asked only for the final one"
    return tokens, done


async def test_kill_9_mid_stream_is_continued_on_the_other_replica(fleet: Fleet) -> None:
    """Stream migration: the router's continuation (chat: the text so far as a final assistant
    message, continue_final_message, no generation prompt) is accepted by vLLM, and the client
    gets one whole stream."""
    max_tokens = 1500  # 4-6 s of generation here: the kill must land while vLLM still generates
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "migrate " + DOCUMENT}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    url = f"{fleet.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        # Killed at the stream's first chunk, on the replica the router names (X-Kvfleet-Replica):
        # the router continues a stream once it has relayed a first byte. On 2 busy cores the whole
        # machine stalls for seconds at times (the test's own event loop too, using no CPU), so a
        # first chunk can be read after vLLM has sent the whole stream: the kill then finds nothing
        # to break, the stream ends whole with no migration, and the round is run again once both
        # replicas serve. The migration is asserted on a round whose kill broke the stream.
        for _round in range(3):
            await _until_two_replicas(fleet)
            before = await _continued(session, fleet.url)
            first, answered_by = asyncio.Event(), list[str]()
            stream = asyncio.create_task(_stream_counting(session, url, body, first, answered_by))
            waiter = asyncio.create_task(first.wait())
            await asyncio.wait({stream, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            busy = [r for r in fleet.replicas() if answered_by and r.replica_id == answered_by[0]]
            if len(busy) == 1 and not stream.done():
                os.killpg(busy[0].child.pid, signal.SIGKILL)  # the whole engine: API server, engine core, worker
            tokens, done = await stream
            # Whether or not the kill broke it, the client's stream is whole: every token once (the
            # router counts the first part by the usage vLLM puts in each chunk, not by chunks).
            assert done, "the client's stream was cut"
            assert tokens == max_tokens, tokens
            if await _continued(session, fleet.url) > before:
                return
        pytest.fail("in three rounds no kill landed while vLLM still generated: no migration to check")


async def _until_two_replicas(fleet: Fleet) -> list[Any]:
    """Both replicas serving (a killed one is restarted by the fleet: a vLLM start, up to a minute);
    returns them. A killed one may still count as ready until it is reaped: alive ones only."""
    for _ in range(int(START_TIMEOUT_S)):
        alive = [r for r in fleet.replicas() if r.child is not None and r.child.process.returncode is None]
        if len(alive) == 2:
            return alive
        await asyncio.sleep(1.0)
    raise AssertionError(f"the fleet is not back to two replicas: {list(fleet.runtime.runs[NAME].processes.events)}")


async def _continued(session: aiohttp.ClientSession, url: str) -> float:
    """The router's count of streams continued on another replica."""
    async with session.get(f"{url}/metrics") as response:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in (await response.text()).splitlines()
            if line.startswith("kvfleet_router_stream_migrations_total{") and 'result="continued"' in line
        )


async def _in_flight(session: aiohttp.ClientSession, url: str) -> float:
    """Requests vLLM holds, by its own /metrics: running plus waiting."""
    total = 0.0
    async with session.get(f"{url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def test_sigterm_lets_running_streams_finish(fleet: Fleet) -> None:
    """The rendered --shutdown-timeout: vLLM finishes what it accepted, then exits."""
    # After kill -9 the fleet restarts the killed replica: wait until both serve again, so that a
    # vLLM start (seconds of both cores) does not stall the replica under test.
    replica = (await _until_two_replicas(fleet))[0]
    assert replica.child is not None
    max_tokens = 1500  # 4-6 s of generation here
    body = {"model": SERVED, "prompt": "drain " + DOCUMENT, "max_tokens": max_tokens, "ignore_eos": True}
    url = f"{replica.url}/v1/completions"  # straight to this replica: the router would spread them
    async with aiohttp.ClientSession() as session:
        # SIGTERM once vLLM itself counts all three in flight: a stream's first chunk is no sign (vLLM
        # sent one stream's first chunk 4 s after the others', just before all three ended). A round
        # that ends before vLLM shows all three (its server stalls for seconds at times on 2 busy
        # cores) drains nothing and is run again; the drain is asserted only on a round that holds.
        for _round in range(3):
            streams = [asyncio.create_task(_stream_counting(session, url, body)) for _ in range(3)]
            in_flight = 0.0
            for _ in range(600):
                in_flight = await _in_flight(session, replica.url)
                if in_flight >= 3 or any(s.done() for s in streams):
                    break
                await asyncio.sleep(0.05)
            if in_flight == 3 and not any(s.done() for s in streams):
                break
            await asyncio.gather(*streams)
        else:
            pytest.fail("in three rounds vLLM never held the three streams at once: nothing to drain")
        started = time.monotonic()
        os.kill(replica.child.pid, signal.SIGTERM)
        results = await asyncio.gather(*streams)
    # Every accepted stream ran to its length and closed with [DONE].
    assert all(done and tokens == max_tokens for tokens, done in results), results
    for _ in range(240):  # and the process does exit
        if replica.child.process.returncode is not None:
            break
        await asyncio.sleep(0.5)
    assert replica.child.process.returncode is not None, "vLLM did not exit after SIGTERM"
    print(f"SIGTERM to exit with 3 streams running: {time.monotonic() - started:.1f} s")
