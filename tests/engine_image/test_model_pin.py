"""The pinned model digest and the node cache's content check, through the real launcher: the real S3
server, the real weight cache, a stand-in engine process and the launcher's real HTTP endpoint."""

from __future__ import annotations

import asyncio
import io
import signal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.engine_image.cache_sources import CacheWeights
from kvfleet.engine_image.errors import LaunchError
from kvfleet.engine_image.launch_spec import LaunchSpec, parse_launch_spec
from kvfleet.engine_image.launcher import LaunchDeps, Launcher
from kvfleet.engine_image.model_pin import read_pin
from kvfleet.engine_image.settings import LauncherSettings
from kvfleet.weight_cache import fetch_manifest
from kvfleet.weight_cache.s3 import S3Client, S3Uri
from tests.conftest import pick_free_port
from tests.engine_image.conftest import PopulatedModel
from tests.engine_image.test_launcher import coldstart, get, standin, until


def settings_for(tmp_path: Path) -> LauncherSettings:
    return LauncherSettings(
        node_cache_dir=tmp_path / "node-cache",
        pin_path=tmp_path / "pin" / "modelDigest",
        engine_port=pick_free_port(),
        metrics_host="127.0.0.1",
        metrics_port=pick_free_port(),
    )


def launch_for(uri: str, **extra: Any) -> LaunchSpec:
    spec = {"model": {"uri": uri}, "engine": {"kind": "reference"}, "resources": {"gpus": 0}, **extra}
    return parse_launch_spec({"name": "m", "spec": spec})


def pin(settings: LauncherSettings, text: str) -> None:
    settings.pin_path.parent.mkdir(parents=True, exist_ok=True)
    settings.pin_path.write_text(text)


async def serve_once(launcher: Launcher, settings: LauncherSettings) -> tuple[dict[str, Any], dict[str, float]]:
    """Run a launch until it served its first token; its /coldstart document and its metrics."""
    task = asyncio.create_task(launcher.run())
    try:

        async def complete() -> bool:
            return bool((await coldstart(settings)).get("complete"))

        await until(complete, timeout_s=60)
        report = await coldstart(settings)
        _, text = await get(f"http://127.0.0.1:{settings.metrics_port}/metrics")
        launcher.handle_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 20) == 0
    finally:
        task.cancel()
        await asyncio.wait({task})
    metrics = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return report, metrics


async def test_a_manifest_other_than_the_pinned_one_is_refused_before_any_download(
    s3_client: S3Client, populated_model: PopulatedModel, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path)
    pin(settings, "ab" * 32 + "\n")
    weights = CacheWeights(settings.node_cache_dir, client=s3_client)
    launcher = Launcher(launch_for(populated_model.uri), settings, LaunchDeps(weights=weights, render=standin()))
    with pytest.raises(LaunchError) as err:
        await asyncio.wait_for(launcher.run(), 60)
    digest = fetch_manifest(s3_client, S3Uri.parse(populated_model.uri)).digest
    assert err.value.one_line() == (
        f"kvfleet launcher failed in phase pull: {populated_model.uri}: model digest is {digest}, but this "
        f"deployment pinned {'ab' * 32} (status.modelDigest); refusing to load other weights. Restore the pinned "
        "model at this location, or change spec.model (uri or revision) to start a new pin"
    )
    # The engine started with the pull (overlap, the default) and was stopped; nothing of the other
    # model was fetched, and its folder never received a file.
    assert launcher._engine is not None and launcher._engine.returncode is not None
    assert not list((settings.node_cache_dir / "models").iterdir())
    assert not list((settings.node_cache_dir / "streams").iterdir())


async def test_the_pinned_model_loads_and_a_planted_file_is_refused_and_fetched_again(
    s3_client: S3Client, populated_model: PopulatedModel, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path)
    digest = fetch_manifest(s3_client, S3Uri.parse(populated_model.uri)).digest
    pin(settings, digest)
    weights = CacheWeights(settings.node_cache_dir, client=s3_client)
    deps = LaunchDeps(weights=weights, render=standin(), engine_stderr=io.BytesIO())
    first, _ = await serve_once(Launcher(launch_for(populated_model.uri), settings, deps), settings)
    assert first["modelDigest"] == digest
    assert first["phaseDetails"]["pull"]["source"] == "s3" and first["phaseDetails"]["pull"]["pinned"] is True

    # Same size, other content, in the node cache: refused on the next start, fetched again, never loaded.
    cached = settings.node_cache_dir / "models" / digest / "model.safetensors"
    size = cached.stat().st_size
    cached.unlink()
    cached.write_bytes(b"\x00" * size)
    settings = settings_for(tmp_path)
    settings.pin_path.write_text(digest)
    second, metrics = await serve_once(Launcher(launch_for(populated_model.uri), settings, deps), settings)
    pull = second["phaseDetails"]["pull"]
    assert pull["source"] == "s3" and pull["bytesFetched"] == size  # only the planted file came again
    assert pull["refusedFiles"] == 1
    assert pull["refused"] == ["model.safetensors: sha256 differs from the manifest's (a damaged or planted file)"]
    assert metrics["kvfleet_coldstart_node_cache_refused_files"] == 1.0
    assert cached.read_bytes() == (populated_model.local / "model.safetensors").read_bytes()

    # And a clean hit after that: every file hashed against the manifest, nothing refused.
    settings = settings_for(tmp_path)
    settings.pin_path.write_text(digest)
    third, metrics = await serve_once(Launcher(launch_for(populated_model.uri), settings, deps), settings)
    pull = third["phaseDetails"]["pull"]
    assert pull["source"] == "node-cache" and pull["verify"] == "sha256" and "refused" not in pull
    assert pull["hashedBytes"] == sum(p.stat().st_size for p in populated_model.local.iterdir())
    assert metrics["kvfleet_coldstart_node_cache_refused_files"] == 0.0

    # spec.cache.nodeCache.verifyOnHit: stat: files untouched since that hash verified them are not hashed.
    settings = settings_for(tmp_path)
    settings.pin_path.write_text(digest)
    stat_launch = launch_for(populated_model.uri, cache={"nodeCache": {"verifyOnHit": "stat"}})
    fourth, _ = await serve_once(Launcher(stat_launch, settings, deps), settings)
    pull = fourth["phaseDetails"]["pull"]
    assert (pull["source"], pull["verify"], pull["hashedBytes"]) == ("node-cache", "stat", 0)


def test_the_pin_file_absent_empty_or_malformed(tmp_path: Path) -> None:
    path = tmp_path / "modelDigest"
    assert read_pin(path) is None  # outside Kubernetes: nothing pinned
    path.write_text("")
    assert read_pin(path) is None  # the operator's ConfigMap before the first pod served
    path.write_text("cd" * 32 + "\n")
    assert read_pin(path) == "cd" * 32
    path.write_text("sha256:" + "cd" * 32)
    with pytest.raises(LaunchError, match="is not a sha256 hex digest: 'sha256:cdcd"):
        read_pin(path)
    path.write_text("a" * 5000)
    with pytest.raises(LaunchError, match=r"is not a sha256 hex digest: 'a{80}\.\.\.'"):
        read_pin(path)


async def test_a_local_model_is_held_to_the_pin_too(tmp_path: Path) -> None:
    from kvfleet.engine_image.sources import LocalWeights

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    settings = settings_for(tmp_path)
    pin(settings, "ef" * 32)
    launcher = Launcher(launch_for(f"file://{model}"), settings, LaunchDeps(weights=LocalWeights(tmp_path)))
    with pytest.raises(LaunchError, match=f"but this deployment pinned {'ef' * 32}"):
        await asyncio.wait_for(launcher.run(), 30)
    assert launcher._engine is None
