"""The launcher (`kvfleet engine launch`, the engine image's entrypoint) with ``engine.kind: vllm``
and ``resources.gpus: 0``: it pulls the weights from the real S3 server (SeaweedFS), renders vLLM's command
(``render_vllm``), starts vLLM's CPU build, reports the cold start, serves, and on SIGTERM vLLM
finishes the stream it is running and both exit 0. One vLLM start."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet.local.models import VLLM_TINY_MODEL
from kvfleet.weight_cache import populate
from kvfleet.weight_cache.s3 import S3Client
from kvfleet_testkit.manifests import vllm_cpu_launcher_spec
from kvfleet_testkit.seaweedfs import SeaweedS3
from tests.engine_image.conftest import (  # the launcher tests' fixtures: the real S3 server, launchers
    LauncherProcess,
    launcher_env,
    launchers,  # noqa: F401
    s3_client,  # noqa: F401
    wait_until,
)
from tests.support.sse import DONE, data_events

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]
START_TIMEOUT_S = 900.0  # pull, three interpreters' imports, model load, on 2 shared cores


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


async def _stream(url: str, body: dict[str, Any], first: asyncio.Event) -> tuple[int, bool]:
    """(tokens generated, by the stream's final usage; ended with [DONE])."""
    tokens, done = 0, False
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for event in data_events(response):
            if event == DONE:
                done = True
            elif isinstance(event, dict):
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
                first.set()
    return tokens, done


def test_launcher_starts_vllm_on_cpu_and_drains_it(
    vllm_installed: None,
    tmp_path: Path,
    s3_client: S3Client,  # noqa: F811
    seaweedfs: SeaweedS3,
    launchers: list[LauncherProcess],  # noqa: F811
) -> None:
    spec = _tiny_vllm_on_s3(tmp_path, s3_client, "tiny")
    launcher = LauncherProcess(spec, tmp_path, launcher_env(seaweedfs, tmp_path / "node"))
    launchers.append(launcher)
    report = wait_until(
        lambda: (
            (doc := _get_json(f"http://127.0.0.1:{launcher.metrics_port}/coldstart")) and doc.get("complete") and doc
        ),
        START_TIMEOUT_S,
        "vLLM's cold start through the launcher",
        launcher,
    )
    assert report["phaseDetails"]["pull"]["source"] == "s3", report
    print(f"launcher cold start with vLLM: {json.dumps(report['phases'])}")
    log = launcher.log
    assert "vllm.entrypoints.openai.api_server" in log and "--kv-cache-memory-bytes" in log, log[-3000:]
    assert "--shutdown-timeout" in log, "the drain budget must reach vLLM"

    # SIGTERM while a stream runs: the launcher forwards it, vLLM finishes the stream, both exit 0.
    url = f"http://127.0.0.1:{launcher.engine_port}/v1/completions"
    body = {"model": "tiny", "prompt": "launcher drain test " * 8, "max_tokens": 300, "ignore_eos": True}

    async def drain() -> tuple[tuple[int, bool], int]:
        first = asyncio.Event()
        stream = asyncio.create_task(_stream(url, body, first))
        await asyncio.wait_for(first.wait(), 120)
        assert not stream.done()
        code = await asyncio.to_thread(launcher.stop, 120.0)
        return await stream, code

    (tokens, done), code = asyncio.run(drain())
    assert done and tokens == 300, (tokens, done)  # every token of the accepted stream
    assert code == 0, launcher.log[-3000:]
    assert "signal_forwarded" in launcher.log


def test_launcher_starts_vllm_with_runai_streamer_on_the_node_caches_files(
    vllm_installed: None,
    tmp_path: Path,
    s3_client: S3Client,  # noqa: F811
    seaweedfs: SeaweedS3,
    launchers: list[LauncherProcess],  # noqa: F811
) -> None:
    """``--vllm-load-format runai_streamer``: vLLM reads the node cache's verified files with Run:ai's
    streamer (never the bucket: the launcher hands it the local folder) and answers a completion."""
    spec = _tiny_vllm_on_s3(tmp_path, s3_client, "tiny-runai")
    env = launcher_env(seaweedfs, tmp_path / "node")
    env["RUNAI_STREAMER_LOG_TO_STDERR"] = "1"  # the streamer's own lines, which say it did the load
    launcher = LauncherProcess(spec, tmp_path, env, extra_args=("--vllm-load-format", "runai_streamer"))
    launchers.append(launcher)
    wait_until(
        lambda: (
            (doc := _get_json(f"http://127.0.0.1:{launcher.metrics_port}/coldstart")) and doc.get("complete") and doc
        ),
        START_TIMEOUT_S,
        "vLLM's cold start with runai_streamer through the launcher",
        launcher,
    )
    log = launcher.log
    argv = _engine_argv(log)
    assert argv[argv.index("--load-format") + 1] == "runai_streamer", argv
    model = Path(argv[argv.index("--model") + 1])
    assert model.is_relative_to(tmp_path / "node"), f"vLLM must read the node cache's files, not {model}"
    assert not any(a.startswith("s3://") for a in argv), argv
    assert "RunAI Streamer" in log, log[-3000:]  # the streamer, not vLLM's own safetensors loader, read them
    body = {"model": "tiny", "prompt": "runai streamer test", "max_tokens": 8, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{launcher.engine_port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["usage"]["completion_tokens"] == 8, answer
    assert answer["choices"][0]["text"], answer
    assert launcher.stop(120.0) == 0, launcher.log[-3000:]


def _tiny_vllm_on_s3(tmp_path: Path, s3: S3Client, name: str) -> dict[str, Any]:
    """A tiny model populated into a new bucket of the real S3 server, and the launcher's vLLM spec on it."""
    from kvfleet.engine.tiny_model import make_tiny_model

    local = make_tiny_model(tmp_path / "model", **VLLM_TINY_MODEL)
    bucket = f"vllm-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/models/tiny"
    populate(s3, local, uri)
    return vllm_cpu_launcher_spec(name, "tiny", uri, bucket)


def _engine_argv(log: str) -> list[str]:
    """The command the launcher started vLLM with (its ``engine_command`` event)."""
    for line in log.splitlines():
        start = line.find('{"event": "engine_command"')
        if start >= 0:
            return list(json.loads(line[start:])["argv"])
    raise AssertionError(f"no engine_command in the launcher's log: {log[-3000:]}")
