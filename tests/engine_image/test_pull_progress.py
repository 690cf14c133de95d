"""A real weight pull (boto3 against the real S3 server, SeaweedFS) through the launcher: progress lines in its
log at a bounded rate, the pull's bytes in its metrics, and its /progress document."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.engine_image.cache_sources import CacheWeights
from kvfleet.engine_image.launch_spec import parse_launch_spec
from kvfleet.engine_image.launcher import LaunchDeps, Launcher, progress_log_due
from kvfleet.engine_image.settings import LauncherSettings
from kvfleet.weight_cache import PullSettings, populate
from kvfleet.weight_cache.s3 import S3Client
from kvfleet.weight_cache.settings import ProgressSettings
from tests.conftest import pick_free_port

from .test_launcher import coldstart, get, standin, until

MiB = 1 << 20
# 48 MiB in 512 KiB ranged GETs, one at a time: SeaweedFS on loopback answers each in ~5-20 ms on
# this shared machine, so the pull lasts about 0.5-2 s, long enough for several progress lines at the
# test's 0.1 s interval.
MODEL = {"model-00001-of-00002.safetensors": 30 * MiB, "model-00002-of-00002.safetensors": 18 * MiB, "config.json": 64}
SLOW_PULL = PullSettings(concurrency=1, part_size_bytes=MiB // 2, stream_chunk_bytes=128 * 1024, fsync=False)
LOG_INTERVAL_S = 0.1


@pytest.mark.parametrize(
    ("last", "now", "due"), [(None, 0.0, True), (10.0, 19.9, False), (10.0, 20.0, True), (10.0, 35.0, True)]
)
def test_progress_lines_are_rate_bounded(last: float | None, now: float, due: bool) -> None:
    assert progress_log_due(last, now, interval_s=10.0) is due


def test_log_interval_is_bounded() -> None:
    with pytest.raises(ValueError, match="progress_log_interval_s"):
        LauncherSettings(progress_log_interval_s=0.01)


@pytest.fixture(scope="module")
def model_uri(s3_client: S3Client, tmp_path_factory: pytest.TempPathFactory) -> str:
    src = tmp_path_factory.mktemp("model")
    for rel, size in MODEL.items():
        (src / rel).write_bytes(random.Random(rel).randbytes(size))
    bucket = f"progress-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/models/m"
    populate(s3_client, src, uri)
    return uri


def settings_for(tmp_path: Path) -> LauncherSettings:
    return LauncherSettings(
        node_cache_dir=tmp_path / "node-cache",
        engine_port=pick_free_port(),
        metrics_host="127.0.0.1",
        metrics_port=pick_free_port(),
        progress_log_interval_s=LOG_INTERVAL_S,
        pull_progress=ProgressSettings(rate_window_s=2.0, sample_interval_s=0.05),
    )


def metric_values(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def launch_once(
    s3_client: S3Client, uri: str, settings: LauncherSettings, caplog: pytest.LogCaptureFixture
) -> tuple[list[dict[str, Any]], dict[str, float], dict[str, Any], float]:
    """Run a launch until the engine is ready; its progress lines, metrics, /progress, pull seconds."""
    launch = parse_launch_spec(
        {"name": "m", "spec": {"model": {"uri": uri}, "engine": {"kind": "reference"}, "resources": {"gpus": 0}}}
    )
    weights = CacheWeights(settings.node_cache_dir, client=s3_client, settings=SLOW_PULL)
    deps = LaunchDeps(weights=weights, render=standin(), engine_stderr=io.BytesIO())
    launcher = Launcher(launch, settings, deps)
    caplog.clear()
    task = asyncio.create_task(launcher.run())
    try:

        async def complete() -> bool:
            return bool((await coldstart(settings)).get("complete"))

        await until(complete)
        _, metrics = await get(f"http://127.0.0.1:{settings.metrics_port}/metrics")
        _, progress = await get(f"http://127.0.0.1:{settings.metrics_port}/progress")
        pull_s = (await coldstart(settings))["phases"]["pull"]
        launcher.handle_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 20) == 0
    finally:
        task.cancel()
        await asyncio.wait({task})
    lines = [json.loads(r.getMessage()) for r in caplog.records if '"event": "pull_progress"' in r.getMessage()]
    return lines, metric_values(metrics), json.loads(progress), pull_s


async def test_a_real_pull_logs_progress_and_exports_its_bytes(
    s3_client: S3Client, model_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvfleet.engine_image.launcher")
    total = sum(MODEL.values())
    settings = settings_for(tmp_path)
    started = time.monotonic()
    lines, metrics, progress, pull_s = await launch_once(s3_client, model_uri, settings, caplog)

    # Lines as the pull goes, each with the model's size, bytes growing and never past it.
    assert len(lines) >= 2, f"the pull took {pull_s} s and logged {lines}"
    assert all(line["totalBytes"] == total for line in lines)
    done = [line["doneBytes"] for line in lines]
    assert done == sorted(done) and done[-1] <= total
    assert lines[0]["progress"].startswith(f"pulling {lines[0]['percent']}% (")
    # Bounded: the first right away, then at most one per interval.
    assert len(lines) <= pull_s / LOG_INTERVAL_S + 1
    assert lines[-1]["bytesPerSecond"] > 0 and lines[-1]["etaSeconds"] is not None  # once a sample span exists

    # The metrics count exactly the model's bytes: a clean pull moves each byte once.
    assert metrics["kvfleet_coldstart_pull_downloaded_bytes_total"] == total
    assert metrics["kvfleet_coldstart_pull_done_bytes"] == total
    assert metrics["kvfleet_coldstart_pull_size_bytes"] == total

    # /progress after the pull: the engine serves, and the pull's last figures stay.
    assert progress["phase"] == "serve"
    assert progress["pull"]["doneBytes"] == progress["pull"]["totalBytes"] == total
    assert progress["pull"]["etaSeconds"] == 0.0
    assert time.monotonic() - started < 60

    # The same node again: a node-cache hit moves nothing and logs no progress.
    settings = settings_for(tmp_path)
    lines, metrics, progress, _ = await launch_once(s3_client, model_uri, settings, caplog)
    assert lines == []
    assert metrics["kvfleet_coldstart_pull_downloaded_bytes_total"] == 0
    assert progress == {"phase": "serve", "pull": None}
