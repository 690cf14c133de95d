"""The launcher's orchestration with real processes and a real HTTP endpoint: phases recorded and
served, readiness not delayed by the artifact push, and every failure naming its phase."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet.engine_image.engine_args import EngineCommand, RenderInputs
from kvfleet.engine_image.errors import LaunchError, SpecError
from kvfleet.engine_image.launch_spec import LaunchSpec, parse_launch_spec
from kvfleet.engine_image.launcher import LaunchDeps, Launcher
from kvfleet.engine_image.settings import LauncherSettings
from kvfleet.engine_image.sources import LocalWeights
from kvfleet.spec import InferenceDeploymentSpec
from kvfleet.weight_cache.artifacts import ArtifactOffer, ArtifactPullResult
from kvfleet.weight_cache.fingerprint import Fingerprint
from tests.conftest import pick_free_port

STANDIN = Path(__file__).with_name("standin_engine.py")


def standin(*extra: str) -> Any:
    def render(spec: InferenceDeploymentSpec, inputs: RenderInputs) -> EngineCommand:
        argv = [sys.executable, str(STANDIN), "--port", str(inputs.port), *extra]
        if inputs.artifacts_dir is not None:
            argv += ["--artifacts-dir", str(inputs.artifacts_dir / "reference")]
        return EngineCommand(argv=tuple(argv), env={})

    return render


class DirArtifactStore:
    """Artifacts kept in a local directory, with a signing key (a trusted builder); ``push`` can be
    held to prove readiness does not wait. The signing and checking themselves are tested against
    the real store in test_artifact_trust.py."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.release_push = threading.Event()
        self.release_push.set()
        self.pushed: list[str] = []

    can_push = True

    def restore_local(self, fp: Fingerprint, dest: Path) -> ArtifactPullResult:
        return ArtifactPullResult(hit=False, reason="no copy on this node", key=fp.key)

    def describe(self, fp: Fingerprint) -> ArtifactOffer:
        found = (self.root / fp.key).is_dir()
        return ArtifactOffer(found=found, reason="in the directory" if found else "none", key=fp.key, size_bytes=10)

    def fetch(self, fp: Fingerprint, dest: Path, offer: ArtifactOffer) -> ArtifactPullResult:
        src = self.root / fp.key
        if not src.is_dir():
            return ArtifactPullResult(hit=False, reason="gone", key=fp.key)
        shutil.copytree(src, dest, dirs_exist_ok=True)
        return ArtifactPullResult(hit=True, reason="restored", key=fp.key)

    def push(self, fp: Fingerprint, src: Path, build_seconds: float | None) -> None:
        if not self.release_push.wait(timeout=30):
            raise LaunchError("serve", "push was never released")
        shutil.copytree(src, self.root / fp.key, dirs_exist_ok=True)
        self.pushed.append(fp.key)


def make_launch(model: Path, artifacts: bool = False) -> LaunchSpec:
    spec: dict[str, Any] = {
        "model": {"uri": f"file://{model}"},
        "engine": {"kind": "reference"},
        "resources": {"gpus": 0},
    }
    if artifacts:
        spec["cache"] = {"bucket": "cache-bucket", "artifacts": {"enabled": True}}
    return parse_launch_spec({"name": "tiny", "spec": spec})


def make_settings(tmp_path: Path) -> LauncherSettings:
    return LauncherSettings(
        node_cache_dir=tmp_path / "node-cache",
        engine_port=pick_free_port(),
        metrics_host="127.0.0.1",
        metrics_port=pick_free_port(),
    )


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def until(predicate: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never held")


async def coldstart(settings: LauncherSettings) -> dict[str, Any]:
    """The launcher's /coldstart document; the status is checked against the contract (503 until complete)."""
    try:
        status, text = await get(f"http://127.0.0.1:{settings.metrics_port}/coldstart")
    except aiohttp.ClientError:
        return {}
    doc: dict[str, Any] = json.loads(text)
    assert status == (200 if doc["complete"] else 503)
    return doc


async def test_phases_are_recorded_served_and_sigterm_drains_the_engine(tmp_path: Path, model_dir: Path) -> None:
    settings = make_settings(tmp_path)
    store = DirArtifactStore(tmp_path / "bucket")
    store.release_push.clear()  # hold the push: readiness must not wait for it
    deps = LaunchDeps(weights=LocalWeights(tmp_path), artifacts=store, render=standin(), engine_stderr=io.BytesIO())
    launcher = Launcher(make_launch(model_dir, artifacts=True), settings, deps)
    task = asyncio.create_task(launcher.run())
    try:

        async def complete() -> bool:
            return bool((await coldstart(settings)).get("complete"))

        await until(complete)
        report = await coldstart(settings)
        assert set(report["phases"]) == {"pull", "artifacts", "engine_start", "first_ready"}
        assert report["phaseDetails"]["pull"]["source"] == "local"
        assert report["phaseDetails"]["artifacts"]["hit"] is False
        assert report["totalSeconds"] == pytest.approx(sum(report["phases"].values()), abs=1e-3)
        assert report["servedName"] == "tiny" and len(report["modelDigest"]) == 64
        assert report["artifactsPushed"] is False and store.pushed == []  # ready while the push is held

        status, metrics = await get(f"http://127.0.0.1:{settings.metrics_port}/metrics")
        assert status == 200
        for phase in ("pull", "artifacts", "engine_start", "first_ready", "total"):
            assert f'kvfleet_coldstart_seconds{{phase="{phase}"}}' in metrics
        assert 'kvfleet_coldstart_cache_hit{cache="artifacts"} 0.0' in metrics

        store.release_push.set()

        async def pushed() -> bool:
            return bool((await coldstart(settings)).get("artifactsPushed"))

        await until(pushed)
        assert store.pushed == [report["artifactsFingerprint"]]
        assert (store.root / report["artifactsFingerprint"] / "reference" / "built.txt").is_file()

        launcher.handle_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 20) == 0
    finally:
        task.cancel()
        await asyncio.wait({task})
    # The endpoint is gone with the launcher.
    with pytest.raises(aiohttp.ClientError):
        await get(f"http://127.0.0.1:{settings.metrics_port}/coldstart")


async def test_engine_exiting_early_fails_engine_start_with_its_last_words(tmp_path: Path, model_dir: Path) -> None:
    deps = LaunchDeps(weights=LocalWeights(tmp_path), render=standin("--exit-early", "5"), engine_stderr=io.BytesIO())
    launcher = Launcher(make_launch(model_dir), make_settings(tmp_path), deps)
    with pytest.raises(LaunchError) as err:
        await asyncio.wait_for(launcher.run(), 30)
    line = err.value.one_line()
    assert line.startswith(
        "kvfleet launcher failed in phase engine_start: engine exited with code 5 before it was ready"
    )
    assert "RuntimeError: model config is broken" in line
    assert "\n" not in line


async def test_engine_never_ready_times_out_and_is_stopped(tmp_path: Path, model_dir: Path) -> None:
    settings = make_settings(tmp_path)
    settings = LauncherSettings(**{**settings.__dict__, "readiness": type(settings.readiness)(ready_timeout_s=1.0)})
    deps = LaunchDeps(weights=LocalWeights(tmp_path), render=standin("--load-s", "999"), engine_stderr=io.BytesIO())
    launcher = Launcher(make_launch(model_dir), settings, deps)
    with pytest.raises(LaunchError) as err:
        await asyncio.wait_for(launcher.run(), 30)
    assert err.value.phase == "engine_start" and "no answer after 1 s" in err.value.reason
    engine = launcher._engine
    assert engine is not None and engine.returncode is not None  # stopped, not orphaned


async def test_missing_weights_fail_the_pull_phase(tmp_path: Path) -> None:
    deps = LaunchDeps(weights=LocalWeights(tmp_path), render=standin(), engine_stderr=io.BytesIO())
    launcher = Launcher(make_launch(tmp_path / "nothing-here"), make_settings(tmp_path), deps)
    with pytest.raises(LaunchError) as err:
        await launcher.run()
    assert err.value.one_line() == (
        f"kvfleet launcher failed in phase pull: no model at {tmp_path / 'nothing-here'} (config.json is missing)"
    )
    assert launcher._engine is None


async def test_busy_metrics_port_fails_before_pulling(tmp_path: Path, model_dir: Path) -> None:
    settings = make_settings(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", settings.metrics_port))
        busy.listen()
        launcher = Launcher(
            make_launch(model_dir), settings, LaunchDeps(weights=LocalWeights(tmp_path), render=standin())
        )
        with pytest.raises(LaunchError) as err:
            await launcher.run()
    assert err.value.phase == "metrics" and str(settings.metrics_port) in err.value.reason
    assert launcher.recorder.records == {}


async def test_unsupported_field_is_refused_before_the_pull(tmp_path: Path, model_dir: Path) -> None:
    launch = parse_launch_spec(
        {
            "name": "tiny",
            "spec": {
                "model": {"uri": f"file://{model_dir}"},
                "engine": {"kind": "reference", "kvCacheDtype": "fp8"},
                "resources": {"gpus": 0},
            },
        }
    )
    launcher = Launcher(launch, make_settings(tmp_path), LaunchDeps(weights=LocalWeights(tmp_path)))
    with pytest.raises(SpecError, match=r"spec\.engine\.kvCacheDtype"):
        await launcher.run()
    assert launcher.recorder.records == {}


async def test_stop_before_the_engine_starts_abandons_the_launch(tmp_path: Path, model_dir: Path) -> None:
    pulling = threading.Event()

    class SlowWeights(LocalWeights):
        def pull(self, launch: LaunchSpec, progress: Any) -> Any:
            pulling.set()
            threading.Event().wait(1.0)
            return super().pull(launch, progress)

    launcher = Launcher(
        make_launch(model_dir), make_settings(tmp_path), LaunchDeps(weights=SlowWeights(tmp_path), render=standin())
    )
    task = asyncio.create_task(launcher.run())
    await asyncio.to_thread(pulling.wait, 10)
    launcher.handle_signal(signal.SIGTERM)
    assert await asyncio.wait_for(task, 10) == 128 + signal.SIGTERM
    assert launcher.interrupted_before_engine


def test_the_drain_budget_comes_from_the_pod() -> None:
    settings = LauncherSettings.from_env({"KVFLEET_DRAIN_TIMEOUT_S": "600"})
    assert settings.stop.grace_s == 600.0
    assert LauncherSettings.from_env({}).stop.grace_s == 30.0  # outside a pod: the launcher's own default
    with pytest.raises(ValueError, match="KVFLEET_DRAIN_TIMEOUT_S"):
        LauncherSettings.from_env({"KVFLEET_DRAIN_TIMEOUT_S": "soon"})


@pytest.mark.parametrize(
    ("model", "where"),
    [
        ({"uri": "hf://org/name", "revision": "abc123"}, "s3://weights/models/hf/org/name/abc123"),
        ({"uri": "hf://org/name@v2"}, "s3://weights/models/hf/org/name/v2"),
        ({"uri": "hf://org/name"}, "s3://weights/models/hf/org/name/main"),
        ({"uri": "s3://other/m"}, "s3://other/m"),
    ],
)
def test_the_launcher_pulls_hf_models_from_the_one_cache_layout(model: dict[str, str], where: str) -> None:
    from kvfleet.engine_image.cache_sources import weights_location
    from kvfleet.weight_cache.s3 import cache_uri_for

    spec = InferenceDeploymentSpec.model_validate(
        {"model": model, "cache": {"bucket": "weights"}, "engine": {"kind": "reference"}, "resources": {"gpus": 0}}
    )
    assert weights_location(spec) == cache_uri_for(spec.model.uri, spec.model.revision, spec.cache) == where
    no_bucket = spec.model_copy(update={"cache": spec.cache.model_copy(update={"bucket": None})})
    if model["uri"].startswith("hf://"):
        with pytest.raises(LaunchError, match=r"spec\.cache\.bucket"):
            weights_location(no_bucket)


def test_the_engine_publishes_kv_events_on_the_launchers_port(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvfleet.engine_image.engine_args import render_engine_command

    settings = replace(make_settings(tmp_path), kv_events_port=6100)
    deps = LaunchDeps(weights=LocalWeights(tmp_path), render=render_engine_command)
    launcher = Launcher(make_launch(tmp_path / "m"), settings, deps)
    argv = launcher._render(tmp_path / "m", None).argv
    config = argv[argv.index("--kv-events-config") + 1]
    assert '"endpoint":"tcp://*:6100"' in config
