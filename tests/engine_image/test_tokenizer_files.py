"""The launcher's ``/tokenizer/{name}`` over real HTTP: only the two tokenizer files, only once the
weights are in place, never past the size bound, each refusal with its reason; and a real launch
serves the files of the model it launched."""

from __future__ import annotations

import asyncio
import io
import json
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvfleet.contracts import TOKENIZER_FILES
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine_image.launcher import LaunchDeps, Launcher
from kvfleet.engine_image.metrics_server import ColdStartMetrics, make_app, start_metrics_server
from kvfleet.engine_image.sources import LocalWeights
from tests.conftest import pick_free_port

from .test_launcher import coldstart, make_launch, make_settings, standin, until


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=1, hidden=32, vocab=512)


async def get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.read()


class Served:
    """The launcher's real app on a free port, with the model folder the test sets."""

    def __init__(self) -> None:
        self.model_dir: Path | None = None
        self.port = pick_free_port()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/tokenizer/{name}"


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    state = Served()
    runner = await start_metrics_server(_app(lambda: state.model_dir), "127.0.0.1", state.port)
    try:
        yield state
    finally:
        await runner.cleanup()


def _app(model_dir: Callable[[], Path | None], max_bytes: int = 4096 * 1024) -> web.Application:
    return make_app(ColdStartMetrics(), dict, dict, model_dir, tokenizer_max_bytes=max_bytes)


def error(body: bytes) -> str:
    return str(json.loads(body)["error"])


async def test_serves_only_the_tokenizer_files_once_the_weights_are_in_place(served: Served, tiny_model: Path) -> None:
    # Before the pull: 503 with the reason, for an allowed name; other names are refused either way.
    status, body = await get(served.url("tokenizer.json"))
    assert (status, error(body)) == (503, "the model's weights are not in place yet")
    status, body = await get(served.url("config.json"))
    assert status == 404 and "only tokenizer.json, tokenizer_config.json" in error(body)

    served.model_dir = tiny_model
    for name in TOKENIZER_FILES:
        status, body = await get(served.url(name))
        assert status == 200 and body == (tiny_model / name).read_bytes()
    # Nothing else of the folder leaves: weights, config, near names, the folder itself.
    for name in ("model.safetensors", "config.json", "tokenizer.json.bak", "Tokenizer.json"):
        status, body = await get(served.url(name))
        assert status == 404, name
        assert "is not served: only tokenizer.json, tokenizer_config.json" in error(body), name
    secrets = {(tiny_model / n).read_bytes() for n in ("config.json", "model.safetensors")}
    # Escapes by (encoded) separators: refused by the allowlist (a decoded '../config.json') or by routing.
    for path in ("..%2Fconfig.json", "../model.safetensors", "%2E%2E/config.json", "x/..%2F..%2Fconfig.json"):
        status, body = await get(f"http://127.0.0.1:{served.port}/tokenizer/{path}")
        assert status == 404 and body not in secrets, (path, body)


async def test_a_missing_or_oversize_file_is_refused_with_its_reason(tmp_path: Path, tiny_model: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(b"x" * 2049)
    (folder / "tokenizer_config.json").mkdir()  # not a regular file: never opened
    port = pick_free_port()
    runner = await start_metrics_server(_app(lambda: folder, max_bytes=2048), "127.0.0.1", port)
    try:
        status, body = await get(f"http://127.0.0.1:{port}/tokenizer/tokenizer.json")
        assert (status, error(body)) == (413, "the model's tokenizer.json is 2049 bytes, over 2048")
        status, body = await get(f"http://127.0.0.1:{port}/tokenizer/tokenizer_config.json")
        assert (status, error(body)) == (404, "the model has no tokenizer_config.json (as a regular file)")
        (folder / "tokenizer.json").write_bytes(b"x" * 2048)  # at the bound: served whole
        status, body = await get(f"http://127.0.0.1:{port}/tokenizer/tokenizer.json")
        assert (status, len(body)) == (200, 2048)
        (folder / "tokenizer.json").unlink()
        status, body = await get(f"http://127.0.0.1:{port}/tokenizer/tokenizer.json")
        assert (status, error(body)) == (404, "the model has no tokenizer.json (as a regular file)")
    finally:
        await runner.cleanup()


async def test_a_launch_serves_the_tokenizer_of_the_model_it_launched(tmp_path: Path, tiny_model: Path) -> None:
    settings = make_settings(tmp_path)
    deps = LaunchDeps(weights=LocalWeights(tmp_path), render=standin(), engine_stderr=io.BytesIO())
    launcher = Launcher(make_launch(tiny_model), settings, deps)
    task = asyncio.create_task(launcher.run())
    try:

        async def complete() -> bool:
            return bool((await coldstart(settings)).get("complete"))

        await until(complete)
        for name in TOKENIZER_FILES:
            status, body = await get(f"http://127.0.0.1:{settings.metrics_port}/tokenizer/{name}")
            assert status == 200 and body == (tiny_model / name).read_bytes()
        launcher.handle_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 20) == 0
    finally:
        task.cancel()
        await asyncio.wait({task})
