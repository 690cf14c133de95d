"""Local mode wires KV-cache events: real engine processes publish on loopback ports of their own, and
the router's view of each engine's cache follows the BlockStored batches the engines send."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.local.runtime import LocalRuntime, load_manifests
from kvfleet.local.settings import LocalSettings, ProcessSettings
from kvfleet.router.prompt_tokens import engine_block_hashes, load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    make_tiny_model(path, layers=1, hidden=32, vocab=512)
    return path


@pytest.fixture
async def runtime(tmp_path: Path, tiny_model: Path) -> AsyncIterator[LocalRuntime]:
    doc = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"uri": f"file://{tiny_model}", "servedName": "m"},
            "engine": {"kind": "reference", "extraArgs": ["--block-size", "4", "--kv-blocks", "256"]},
            "resources": {"gpus": 0, "cpu": "1"},
            "replicas": 2,
        },
    }
    manifests = tmp_path / "m.yaml"
    manifests.write_text(yaml.safe_dump(doc))
    settings = LocalSettings(
        router_port=0,
        status_port=0,
        state_dir=tmp_path / "state",
        tick_s=0.5,
        with_prometheus=False,
        processes=ProcessSettings(ready_timeout_s=120, drain_wait_s=30, term_grace_s=10),
    )
    local = LocalRuntime(load_manifests([manifests]), settings, cwd=tmp_path)
    await local.start()
    try:
        yield local
    finally:
        await local.stop(force=None)
        local.kill_all()


async def test_the_routers_view_follows_what_the_engines_store(runtime: LocalRuntime, tiny_model: Path) -> None:
    assert runtime.router.settings.kv_events_tokenizers == {"m": str(tiny_model)}
    fleet = runtime.router.fleet
    for _ in range(600):  # both engines ready and subscribed to
        caches = fleet.engine_caches("m")
        if caches is not None and len(caches.replica_ids()) == 2:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the router never subscribed to both engines")
    tokenizer = load_tokenizer(tiny_model)
    async with aiohttp.ClientSession() as session:
        for n in range(50):
            # A new prompt each time: a PUB drops what it sends before the subscription reaches it.
            body = {"model": "m", "prompt": f"request {n}: " + "the same long document " * 8, "max_tokens": 2}
            async with session.post(runtime.router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            hashes = engine_block_hashes(tokenizer, body, 4)
            assert hashes
            held = {
                r: state.view.matched_blocks(hashes)
                for r in caches.replica_ids()
                if (state := caches.get(r)) is not None
            }
            if max(held.values()) == len(hashes):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"no engine's view holds the prompt's blocks: {held}")
    # Every block of the prompt arrived as the engine's BlockStored events, with the engine's block size.
    assert caches.block_size() == 4
    assert caches.usable_count() >= 1
    async with aiohttp.ClientSession() as session, session.get(runtime.router.url + "/metrics") as resp:
        text = await resp.text()
    assert re.search(r'kvfleet_router_kv_event_subscriptions\{model="m",namespace="[^"]*"\} 2.0', text), [
        line for line in text.splitlines() if "kv_event" in line
    ]
    # Autoscaling off: the controller leaves the deployment at spec.replicas, and the view still
    # reads its engines once a tick (the samples the window turns into TTFT and prefix hits).
    for _ in range(50):
        view = runtime.status().deployments[0]
        if view.ttft_p50_s is not None and view.prefix_hit_rate is not None:
            break
        await asyncio.sleep(0.1)
    assert view.ttft_p50_s is not None and view.prefix_hit_rate is not None, view
    assert view.current_decision is None and view.desired_replicas == 2, view
