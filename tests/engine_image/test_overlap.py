"""The engine started before the pull ends: the launcher starts the real reference engine on a folder
the pull fills with verified shards (kvfleet.weight_stream), from the real S3 server. The same
prompts give the same tokens with and without overlap; a shard whose bytes differ from the manifest
fails the start in the pull phase naming it, and the engine never loads it."""

from __future__ import annotations

import asyncio
import io
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet.engine_image.cache_sources import CacheWeights
from kvfleet.engine_image.engine_args import RenderInputs, render_engine_command
from kvfleet.engine_image.errors import EngineExitedError, LaunchError
from kvfleet.engine_image.launch_spec import LaunchSpec, parse_launch_spec
from kvfleet.engine_image.launcher import LaunchDeps, Launcher
from kvfleet.engine_image.overlap import decide_overlap, during_pull
from kvfleet.engine_image.readiness import ReadinessSettings
from kvfleet.engine_image.settings import LauncherSettings
from kvfleet.weight_cache import populate
from kvfleet.weight_cache.pull import pull_model
from kvfleet.weight_cache.s3 import S3Client, make_client
from kvfleet.weight_cache.settings import PullSettings, S3Settings
from kvfleet_testkit.fault_proxy import fault_proxy
from kvfleet_testkit.seaweedfs import SeaweedS3
from tests.conftest import pick_free_port
from tests.engine_image.test_launcher import coldstart, until

PROMPTS = ("the quick brown fox", "once upon a time", "kvfleet")


def spec_for(uri: str, kind: str = "reference", **extra: Any) -> LaunchSpec:
    spec = {"model": {"uri": uri}, "engine": {"kind": kind}, "resources": {"gpus": 0}, **extra}
    return parse_launch_spec({"name": "m", "spec": spec})


@pytest.mark.parametrize(
    ("launch", "enabled", "store", "on", "why"),
    [
        (spec_for("s3://bucket-b/m"), True, False, True, "loads each verified shard"),
        (spec_for("hf://org/m", cache={"bucket": "bucket-b"}), True, False, True, "loads each verified shard"),
        (spec_for("s3://bucket-b/m"), False, False, False, "off in the launcher's settings"),
        (spec_for("s3://bucket-b/m", kind="vllm"), True, False, False, "vllm loads a complete model folder"),
        (spec_for("file:///models/m"), True, False, False, "a local model is complete already"),
        (
            spec_for("s3://bucket-b/m", cache={"bucket": "bucket-b", "artifacts": {"enabled": True}}),
            True,
            True,
            False,
            "engine artifacts are on",
        ),
        (
            spec_for("s3://bucket-b/m", cache={"bucket": "bucket-b", "artifacts": {"enabled": True}}),
            True,
            False,
            True,
            "loads",
        ),
    ],
)
def test_when_the_engine_starts_before_the_pull_ends(
    launch: LaunchSpec, enabled: bool, store: bool, on: bool, why: str
) -> None:
    decision = decide_overlap(launch.spec, enabled=enabled, artifacts_store=store)
    assert decision.on is on and why in decision.reason


@pytest.mark.parametrize(
    ("pull_ended", "returncode", "action"),
    [
        (False, None, "wait"),
        (False, 2, "stop_pull"),
        (False, 0, "stop_pull"),  # an engine that ends cleanly during the pull still has no weights
        (True, None, "go_on"),
        (True, 1, "go_on"),  # the pull's own outcome first; engine_start then reports the exit
    ],
)
def test_an_engine_that_exits_during_the_pull_stops_it(pull_ended: bool, returncode: int | None, action: str) -> None:
    decision = during_pull(pull_ended=pull_ended, engine_returncode=returncode)
    assert decision.action == action
    if action == "stop_pull":
        assert f"exited with code {returncode}" in decision.reason


def test_only_the_reference_engine_is_told_to_wait_for_shards() -> None:
    inputs = RenderInputs(model_path=Path("/tmp/x/model"), served_name="m", port=8000, weights_arrival_timeout_s=3600)
    argv = render_engine_command(spec_for("s3://bucket-b/m").spec, inputs).argv
    assert argv[argv.index("--weights-arrival-timeout-s") + 1] == "3600"
    assert argv[argv.index("--model") + 1] == "/tmp/x/model"


@pytest.mark.parametrize(
    ("load_format", "expected"),
    [
        (None, None),
        ("safetensors", ["--load-format", "safetensors"]),
        ("runai_streamer", ["--load-format", "runai_streamer", "--model-loader-extra-config", '{"concurrency":16}']),
    ],
)
def test_vllm_reads_the_node_caches_verified_files_with_the_load_format_asked_for(
    load_format: Any, expected: list[str] | None
) -> None:
    """vLLM lists its model folder at start, so it starts after the pull; the streamer reads the
    node cache's complete files (the path is the node cache's, never the s3:// location)."""
    model = Path("/var/cache/kvfleet/models/" + "ab" * 32)
    inputs = RenderInputs(model_path=model, served_name="m", port=8000, vllm_load_format=load_format)
    argv = list(render_engine_command(spec_for("s3://bucket-b/m", kind="vllm").spec, inputs).argv)
    assert argv[argv.index("--model") + 1] == str(model)
    if expected is None:
        assert "--load-format" not in argv
    else:
        start = argv.index("--load-format")
        assert argv[start : start + len(expected)] == expected
    extra = spec_for("s3://bucket-b/m", kind="vllm", engine={"kind": "vllm", "extraArgs": ["--load-format=auto"]})
    argv = list(render_engine_command(extra.spec, inputs).argv)
    assert argv.count("--load-format") == 0 and argv[-1] == "--load-format=auto"  # the spec's own choice wins


@pytest.fixture(scope="module")
def sharded_model(s3_client: S3Client, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from kvfleet.engine.tiny_model import make_tiny_model

    local = make_tiny_model(
        tmp_path_factory.mktemp("sharded") / "m", layers=4, hidden=256, vocab=2048, heads=8, kv_heads=4, shards=3
    )
    bucket = f"overlap-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/models/m"
    populate(s3_client, local, uri)
    return uri, local


def settings_for(tmp_path: Path, *, overlap: bool) -> LauncherSettings:
    return LauncherSettings(
        node_cache_dir=tmp_path / "node-cache",
        pin_path=tmp_path / "pin",
        engine_port=pick_free_port(),
        metrics_host="127.0.0.1",
        metrics_port=pick_free_port(),
        overlap_pull=overlap,
        readiness=ReadinessSettings(ready_timeout_s=240),
    )


def deps_for(s3_client: S3Client, settings: LauncherSettings, stderr: io.BytesIO) -> LaunchDeps:
    weights = CacheWeights(settings.node_cache_dir, client=s3_client)
    # One torch thread: the machine's two cores are shared by the whole suite.
    return LaunchDeps(weights=weights, engine_stderr=stderr, environ={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})


async def complete(settings: LauncherSettings, prompt: str) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    url = f"http://127.0.0.1:{settings.engine_port}/v1/completions"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        doc = await response.json()
    return str(doc["choices"][0]["text"])


async def serve_and_ask(launcher: Launcher, settings: LauncherSettings) -> tuple[dict[str, Any], list[str]]:
    task = asyncio.create_task(launcher.run())
    try:

        async def ready() -> bool:
            if task.done():
                task.result()  # a failed launch fails the test with its own error
            return bool((await coldstart(settings)).get("complete"))

        await until(ready, timeout_s=300)
        report = await coldstart(settings)
        answers = [await complete(settings, p) for p in PROMPTS]
        launcher.handle_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 60) == 0
    finally:
        task.cancel()
        await asyncio.wait({task})
    return report, answers


@pytest.mark.slow
async def test_overlap_gives_the_same_tokens_as_a_pull_then_start(
    s3_client: S3Client, sharded_model: tuple[str, Path], tmp_path: Path
) -> None:
    uri, _ = sharded_model
    results = {}
    for overlap in (True, False):
        settings = settings_for(tmp_path / str(overlap), overlap=overlap)
        stderr = io.BytesIO()
        launcher = Launcher(spec_for(uri), settings, deps_for(s3_client, settings, stderr))
        results[overlap] = await serve_and_ask(launcher, settings)
        log = stderr.getvalue().decode(errors="replace")
        # Each shard loaded exactly once, by name, in order.
        loaded = [line.split("loaded ")[1].split(":")[0] for line in log.splitlines() if "weights: loaded " in line]
        assert loaded == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)], log[-3000:]
    (on_report, on_answers), (off_report, off_answers) = results[True], results[False]
    assert on_answers == off_answers
    assert all(len(a) > 0 for a in on_answers)
    on_start, off_start = on_report["phaseDetails"]["engine_start"], off_report["phaseDetails"]["engine_start"]
    assert on_start["overlap"] is True and on_start["startedBeforePullEndS"] > 0
    assert off_start["overlap"] is False and "startedBeforePullEndS" not in off_start
    assert on_report["phaseDetails"]["pull"]["source"] == off_report["phaseDetails"]["pull"]["source"] == "s3"


@pytest.mark.slow
async def test_a_corrupt_shard_fails_the_start_naming_it_and_is_never_loaded(
    s3_client: S3Client, sharded_model: tuple[str, Path], tmp_path: Path
) -> None:
    _, local = sharded_model
    bucket = f"corrupt-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/models/m"
    populate(s3_client, local, uri)
    bad = "model-00002-of-00003.safetensors"
    size = (local / bad).stat().st_size
    s3_client.put_object(Bucket=bucket, Key=f"models/m/{bad}", Body=b"\x07" * size)  # same size, other bytes

    settings = settings_for(tmp_path, overlap=True)
    stderr = io.BytesIO()
    launcher = Launcher(spec_for(uri), settings, deps_for(s3_client, settings, stderr))
    with pytest.raises(LaunchError) as err:
        await asyncio.wait_for(launcher.run(), 240)
    assert err.value.phase == "pull"
    assert f"checksum failed for {uri}: {bad}: sha256 is" in err.value.reason
    engine = launcher._engine
    assert engine is not None and engine.returncode is not None  # started during the pull, then stopped
    log = stderr.getvalue().decode(errors="replace")
    assert f"loaded {bad}" not in log
    stream = settings.node_cache_dir / "streams"
    assert not any(p.name == bad for p in stream.rglob("*"))
    assert not any((settings.node_cache_dir / "models").iterdir())
    # The launcher's own symlink folder is gone too.
    assert launcher._stream_dir is not None and not launcher._stream_dir.exists()


# The slow link: 256 KiB/s per connection, one connection, 64 KiB parts (a part is the unit the
# journal records, so a pull stopped after a second has parts to resume from).
SLOW_LINK_BYTES_PER_S = 256 * 1024
ONE_SLOW_CONNECTION = PullSettings(
    concurrency=1, part_size_bytes=64 * 1024, stream_chunk_bytes=64 * 1024, retry_backoff_s=0.0
)


@pytest.mark.slow
async def test_an_engine_that_exits_during_a_slow_pull_stops_it_and_fails_the_start_naming_the_engine(
    seaweedfs: SeaweedS3, s3_client: S3Client, sharded_model: tuple[str, Path], tmp_path: Path
) -> None:
    """A real engine that refuses its settings at once (the reference engine's own check of
    --block-size) beside a pull through a slow link: the launch fails in engine_start with the
    engine's exit code and words long before the pull would have ended, the pull stops, nothing
    partial reaches the node cache's models or the engine's folder, and a later pull resumes."""
    _, local = sharded_model
    bucket = f"stopped-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/models/m"
    populate(s3_client, local, uri)
    total_bytes = sum(f.stat().st_size for f in local.rglob("*") if f.is_file())
    pull_alone_s = total_bytes / SLOW_LINK_BYTES_PER_S
    assert pull_alone_s > 30, f"the model ({total_bytes} bytes) is too small to tell a stop from the end"

    creds = tmp_path / "aws"
    creds.mkdir()
    (creds / "AWS_ACCESS_KEY_ID").write_text(seaweedfs.access_key)
    (creds / "AWS_SECRET_ACCESS_KEY").write_text(seaweedfs.secret_key)
    settings = settings_for(tmp_path, overlap=True)
    launch = spec_for(uri, engine={"kind": "reference", "extraArgs": ["--block-size", "0"]})
    stderr = io.BytesIO()
    with fault_proxy(seaweedfs.endpoint_url) as proxy:
        proxy.slow_down(SLOW_LINK_BYTES_PER_S)
        slow = make_client(S3Settings(endpoint_url=proxy.url, region=seaweedfs.region, credentials_dir=creds))
        weights = CacheWeights(settings.node_cache_dir, client=slow, settings=ONE_SLOW_CONNECTION)
        deps = LaunchDeps(weights=weights, engine_stderr=stderr, environ={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
        launcher = Launcher(launch, settings, deps)
        began = time.monotonic()
        with pytest.raises(EngineExitedError) as err:
            await asyncio.wait_for(launcher.run(), pull_alone_s)
        took_s = time.monotonic() - began
        fetched_while_failing = proxy.connections

    assert err.value.phase == "engine_start"
    assert err.value.returncode == 2
    assert "engine exited with code 2 before it was ready" in err.value.reason
    assert "--block-size" in err.value.reason  # the engine's own words, from the tail of its log
    # Stopped within a few seconds (the engine's start plus one chunk read), not at the pull's end.
    assert took_s < min(20.0, pull_alone_s / 3), (took_s, pull_alone_s)
    assert fetched_while_failing >= 1
    assert "pull" not in launcher.recorder.records  # the pull did not complete
    # The pull's thread ended: no byte moves after the launch failed.
    before = launcher.pull_progress.report()
    await asyncio.sleep(1.0)
    after = launcher.pull_progress.report()
    assert (before and before.downloaded_bytes) == (after and after.downloaded_bytes)

    cache = settings.node_cache_dir
    assert not any((cache / "models").iterdir())  # nothing unverified is loadable from the node cache
    for path in (cache / "streams").rglob("*"):
        if path.is_file() and not path.name.startswith(".kvfleet-"):
            relative = path.relative_to(next((cache / "streams").iterdir()))
            assert path.read_bytes() == (local / relative).read_bytes()  # only whole, verified files
    partial = [p for p in cache.rglob("*.part")]
    assert all("staging" in p.relative_to(cache).parts for p in partial), partial
    assert launcher._stream_dir is not None and not launcher._stream_dir.exists()

    # The next pull of the model on this node completes from what the stopped one left (its
    # resume from the journal: tests/weight_cache/test_faults_real.py).
    again = await asyncio.to_thread(
        pull_model, uri, cache, ONE_SLOW_CONNECTION.model_copy(update={"concurrency": 4}), client=s3_client
    )
    with again:
        assert (again.path / "config.json").read_bytes() == (local / "config.json").read_bytes()
