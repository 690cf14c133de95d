"""A model's tokenizer fetched from its own replica's launcher over real HTTP: the real launcher app
serving a tiny model's real files, publishers on real ZeroMQ sockets. The fleet installs the
tokenizer and tokenizes from then on; oversize, refusing, silent and absent launchers are counted
and retried, never fatal to a request; one fetch at a time per model; a mounted tokenizer is kept."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from support.event_publisher import Publisher, publish_until_usable

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.tokenizer import ModelTokenizer
from kvfleet.engine_image.metrics_server import ColdStartMetrics, make_app, start_metrics_server
from kvfleet.router.fleet import Fleet
from kvfleet.router.kv_events import token_block_hashes
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.prompt_tokens import PromptTokenizer
from kvfleet.router.replicas import DeploymentView, Endpoint, StaticReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.tokenizer_fetch import (
    FetchBounds,
    TokenizerFetcher,
    fetch_candidates,
    launcher_url,
    retry_delay_s,
)
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec

from .conftest import pick_free_port, route_as_the_proxy, until


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=1, hidden=32, vocab=512)


class Launcher:
    """The engine image's real launcher app on a free port; ``model_dir`` None until the 'pull' is done."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.model_dir: Path | None = None
        self.port = pick_free_port()
        self.app = make_app(ColdStartMetrics(), dict, dict, lambda: self.model_dir, tokenizer_max_bytes=max_bytes)


@pytest.fixture
async def launcher() -> AsyncIterator[Launcher]:
    served = Launcher()
    runner = await start_metrics_server(served.app, "127.0.0.1", served.port)
    yield served
    await runner.cleanup()


def fetches(fleet: Fleet, outcome: str) -> float:
    return float(fleet._metrics.tokenizer_fetches.values.get(("default", "m", outcome), 0.0))


async def make_fleet(
    publishers: list[Publisher], launcher_port: int | None, **overrides: object
) -> tuple[Fleet, StaticReplicaSource]:
    settings = RouterSettings(
        kv_events_port=1,  # every replica here names its own port
        kv_events_reconnect_s=0.05,
        kv_events_reconnect_max_s=0.2,
        placement=False,
        kv_events_replay=False,
        **overrides,  # type: ignore[arg-type]
    )
    fleet = Fleet(settings, NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=16))
    for i, p in enumerate(publishers):
        source.add("m", f"r{i}", f"http://127.0.0.1:{9000 + i}", kv_events_port=p.port, launcher_port=launcher_port)
    await source.start(fleet)
    return fleet, source


def pick(fleet: Fleet, body: dict[str, object]) -> tuple[str, list[int] | None]:
    """Route ``body`` as the proxy does; the replica and the engine blocks it was tokenized into."""
    return route_as_the_proxy(fleet, body)


async def test_a_fetched_tokenizer_is_installed_and_prompts_are_tokenized_from_then_on(
    tiny_model: Path, launcher: Launcher, publishers: list[Publisher]
) -> None:
    fleet, source = await make_fleet(publishers, launcher.port)
    try:
        text = "the same long document about routing " * 8
        ids = ModelTokenizer.from_dir(tiny_model).encode(text)
        await publish_until_usable(fleet, publishers[1], "r1", [500] * 4, 1000)
        await publish_until_usable(fleet, publishers[0], "r0", ids[:40], 2000)
        # The launcher's weights are not in place yet (503): counted, retried; requests meanwhile are
        # routed by the learned index, untokenized, as without a tokenizer.
        await until(lambda: fetches(fleet, "status") >= 1, timeout_s=5)
        assert pick(fleet, {"prompt": "other"})[1] is None
        launcher.model_dir = tiny_model
        await until(lambda: fetches(fleet, "ok") == 1, timeout_s=10)
        # From now on prompts are cut into the engine's token blocks, and r0's report draws the text there.
        replica, engine_blocks = pick(fleet, {"prompt": text})
        assert engine_blocks == token_block_hashes(ids, 4)
        assert replica == "r0"
        # The chat template came too (tokenizer_config.json): chats are rendered as the engine does.
        messages = [{"role": "user", "content": "hi"}]
        assert pick(fleet, {"messages": messages})[1]
        assert fleet._tokenizers.fetcher is not None and not fleet._tokenizers.fetcher.fetching("default/m")
        assert fetches(fleet, "ok") == 1  # once: new views of the model fetch nothing more
        # A routing change rebuilds the model's strategy: the fetched tokenizer stays with it.
        source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=16, max_queue=7))
        assert pick(fleet, {"prompt": text}) == ("r0", token_block_hashes(ids, 4))
        assert fetches(fleet, "ok") == 1
        # The model goes, with its fetched tokenizer and its series; when it comes back it is fetched again.
        source.remove_deployment("m")
        assert fleet._tokenizers.get("m") is None
        for i, p in enumerate(publishers):
            source.add("m", f"r{i}", f"http://127.0.0.1:{9000 + i}", kv_events_port=p.port, launcher_port=launcher.port)
        await until(lambda: fetches(fleet, "ok") == 1 and fleet._tokenizers.get("m") is not None, timeout_s=10)
    finally:
        await fleet.close()


async def test_a_mounted_tokenizer_wins_and_nothing_is_fetched(
    tiny_model: Path, launcher: Launcher, publishers: list[Publisher]
) -> None:
    launcher.model_dir = tiny_model
    fleet, source = await make_fleet(publishers, launcher.port, kv_events_tokenizers={"m": str(tiny_model)})
    try:
        mounted = fleet._tokenizers.get("m")
        assert mounted is not None and fleet._tokenizers.fetcher is not None
        source.add("m", "r2", "http://127.0.0.1:9002", kv_events_port=publishers[0].port, launcher_port=launcher.port)
        assert not fleet._tokenizers.fetcher.fetching("default/m")  # offers are refused at once
        await asyncio.sleep(0.2)
        assert fleet._tokenizers.get("m") is mounted and fetches(fleet, "ok") == 0
    finally:
        await fleet.close()


async def test_fetching_can_be_turned_off_and_a_replica_without_a_launcher_port_is_never_asked(
    tiny_model: Path, launcher: Launcher, publishers: list[Publisher]
) -> None:
    launcher.model_dir = tiny_model
    fleet, _ = await make_fleet(publishers, launcher.port, kv_events_fetch_tokenizers=False)
    try:
        assert fleet._tokenizers.fetcher is None and fleet._tokenizers.get("m") is None
    finally:
        await fleet.close()
    # Static and local replicas have no launcher port: nothing to ask.
    fleet, _ = await make_fleet(publishers, None)
    try:
        assert fleet._tokenizers.fetcher is not None and not fleet._tokenizers.fetcher.fetching("default/m")
    finally:
        await fleet.close()


def test_candidates_and_retry_delays() -> None:
    ok = Endpoint("a", "http://10.0.0.1:8000", kv_events_port=5557, launcher_port=9400)
    assert fetch_candidates(
        [
            ok,
            Endpoint("draining", "http://10.0.0.2:8000", draining=True, kv_events_port=5557, launcher_port=9400),
            Endpoint("no-events", "http://10.0.0.3:8000", launcher_port=9400),
            Endpoint("no-launcher", "http://10.0.0.4:8000", kv_events_port=5557),
        ]
    ) == [ok]
    assert launcher_url(ok, "tokenizer.json") == "http://10.0.0.1:9400/tokenizer/tokenizer.json"
    v6 = Endpoint("b", "https://[fd00::1]:8443", kv_events_port=5557, launcher_port=9400)
    assert launcher_url(v6, "tokenizer_config.json") == "http://[fd00::1]:9400/tokenizer/tokenizer_config.json"
    bounds = FetchBounds(retry_first_s=1.0, retry_max_s=120.0)
    delays = [retry_delay_s(n, bounds, random.Random(1)) for n in (1, 2, 3, 8, 100)]
    for delay, base in zip(delays, (1, 2, 4, 120, 120), strict=True):
        assert base * 0.5 <= delay <= base


class Installed:
    def __init__(self) -> None:
        self.tokenizers: list[PromptTokenizer] = []

    def __call__(self, view: DeploymentView, tokenizer: PromptTokenizer) -> None:
        self.tokenizers.append(tokenizer)


def view_of(*ports: int) -> DeploymentView:
    endpoints = tuple(
        Endpoint(f"r{i}", f"http://127.0.0.1:{9000 + i}", kv_events_port=5557, launcher_port=port)
        for i, port in enumerate(ports)
    )
    return DeploymentView("m", "default", "m", RoutingSpec(), endpoints)


async def test_oversize_failing_silent_and_absent_launchers_are_counted_and_retried(tiny_model: Path) -> None:
    """One replica's launcher misbehaves a different way on each try; the fetcher moves on to the
    next replica after each failure, and the fifth try (a good launcher) installs the tokenizer."""
    tries: list[str] = []
    behaviours = ["oversize-chunked", "oversize-declared", "refuse", "silent"]

    async def tokenizer_file(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        how = behaviours[len(tries)] if len(tries) < len(behaviours) else "ok"
        if name == "tokenizer.json":
            tries.append(how)
        if how == "oversize-chunked":  # no length announced: the reader stops at the bound
            response = web.StreamResponse()
            await response.prepare(request)
            for _ in range(64):
                await response.write(b"x" * 64 * 1024)
            return response
        if how == "oversize-declared":
            return web.Response(body=b"x" * (2 * 1024 * 1024))
        if how == "refuse":
            return web.json_response({"error": "disk on fire"}, status=500)
        if how == "silent":  # past the client's timeout; the client gives up and closes the connection
            await asyncio.sleep(2)
        return web.Response(body=(tiny_model / name).read_bytes())

    app = web.Application()
    app.router.add_get("/tokenizer/{name}", tokenizer_file)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    good = pick_free_port()
    await web.TCPSite(runner, "127.0.0.1", good).start()
    absent = pick_free_port()  # nothing listens: connection refused
    metrics, installed = RouterMetrics(), Installed()
    bounds = FetchBounds(timeout_s=0.5, max_file_bytes=1024 * 1024, retry_first_s=0.01, retry_max_s=0.05)
    fetcher = TokenizerFetcher(metrics, installed, cache_tokens=0, bounds=bounds)
    try:
        view = view_of(good, absent)  # tries alternate: good (misbehaving), absent, good, absent, ...
        for _ in range(5):
            fetcher.offer(view)  # new views while a fetch runs start no second one
        await until(lambda: bool(installed.tokenizers), timeout_s=15)
        counted = {labels[2]: value for labels, value in metrics.tokenizer_fetches.values.items()}
        assert counted == {"oversize": 2, "unreachable": 4, "status": 1, "timeout": 1, "ok": 1}, counted
        # One sequence of tries, whatever the offers: two fetches at once would have asked twice as often.
        assert tries == ["oversize-chunked", "oversize-declared", "refuse", "silent", "ok"]
        tokenizer = installed.tokenizers[0]
        assert tokenizer.encode("hello there") == ModelTokenizer.from_dir(tiny_model).encode("hello there")
        assert not fetcher.fetching(view.key)
    finally:
        await fetcher.close()
        await runner.cleanup()


async def test_a_missing_invalid_or_unwritable_tokenizer_is_counted_and_a_gone_model_stops_its_fetch(
    tmp_path: Path, tiny_model: Path
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    launcher = Launcher()
    launcher.model_dir = folder  # no tokenizer.json at all
    runner = await start_metrics_server(launcher.app, "127.0.0.1", launcher.port)
    metrics, installed = RouterMetrics(), Installed()
    bounds = FetchBounds(timeout_s=2, retry_first_s=0.01, retry_max_s=0.02)
    not_a_folder = tmp_path / "tmp"  # the router's temporary folder cannot be used
    not_a_folder.write_text("")
    fetcher = TokenizerFetcher(metrics, installed, cache_tokens=0, bounds=bounds, tmp_dir=str(not_a_folder))

    def counted(outcome: str) -> float:
        return metrics.tokenizer_fetches.values.get(("default", "m", outcome), 0)

    view = view_of(launcher.port)
    try:
        fetcher.offer(view)
        await until(lambda: counted("missing") >= 2, timeout_s=5)
        (folder / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
        await until(lambda: counted("write") >= 1, timeout_s=5)
        fetcher.forget(view.key)  # the model is gone: its fetch stops, nothing is installed
        assert not fetcher.fetching(view.key)
        await asyncio.sleep(0.1)
        assert installed.tokenizers == []
    finally:
        await fetcher.close()
    # A file the tokenizers library refuses: counted, and nothing stays in the temporary folder.
    (folder / "tokenizer.json").write_text("{not json")
    tmp = tmp_path / "router-tmp"
    tmp.mkdir()
    slow = FetchBounds(timeout_s=2, retry_first_s=60, retry_max_s=60)  # no next try while the folder is checked
    fetcher = TokenizerFetcher(metrics, installed, cache_tokens=0, bounds=slow, tmp_dir=str(tmp))
    try:
        fetcher.offer(view)
        await until(lambda: counted("invalid") == 1, timeout_s=5)
        assert list(tmp.iterdir()) == [] and installed.tokenizers == []
        assert fetcher.fetching(view.key)  # waiting to try again: a replica may serve a good one later
    finally:
        await fetcher.close()
        await runner.cleanup()
