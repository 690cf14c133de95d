"""vLLM's torch.compile cache as a launcher artifact: a builder's launch compiles (vLLM's CPU build
compiles the model once with Inductor, dynamic shapes: ``DYNAMO_TRACE_ONCE``), the launcher takes
``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR`` as the artifact and pushes it, signed; an engine
pod on a fresh node restores it from the bucket before vLLM starts, by the launcher's rule (used
only when the fetch costs less than the build it replaces), and starts faster. Two vLLM starts, one
compile: the smallest real configuration (one layer, 64-wide heads, one sequence, 256 tokens)."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvfleet.local.models import VLLM_TINY_MODEL
from kvfleet.weight_cache import populate
from kvfleet.weight_cache.s3 import S3Client
from kvfleet.weight_cache.signing import generate_key_pair, public_pem
from kvfleet_testkit.seaweedfs import SeaweedS3
from tests.engine_image.conftest import (  # the launcher tests' fixtures: the real S3 server, launchers
    LauncherProcess,
    launcher_env,
    launchers,  # noqa: F401
    s3_client,  # noqa: F401
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]
START_TIMEOUT_S = 1500.0  # pull, three interpreters, a compile on 2 shared cores
# vLLM's CPU model runner's warm-up, which compiles the model (cpu_model_runner.py), in its log.
_WARMUP = re.compile(r"(\d\d):(\d\d):(\d\d) \[cpu_model_runner\.py:\d+\] Warming up (model for the compilation|done)")


def _warmup_s(log: str) -> float:
    """Seconds from vLLM's "Warming up model for the compilation..." to "Warming up done."."""
    found = [(int(h) * 3600 + int(m) * 60 + int(s), what) for h, m, s, what in _WARMUP.findall(log)]
    begin = [t for t, what in found if what != "done"]
    end = [t for t, what in found if what == "done"]
    assert begin and end, "vLLM's warm-up lines not found"
    return float((end[-1] - begin[-1]) % 86400)


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _spec(uri: str, bucket: str) -> dict[str, Any]:
    return {
        "name": "tiny",
        "namespace": "default",
        "servedName": "tiny",
        "spec": {
            "model": {"uri": uri},
            "engine": {
                "kind": "vllm",
                "maxModelLen": 256,
                "dtype": "float32",
                # No --enforce-eager: vLLM compiles. One sequence and 256 batched tokens bound the
                # warm-up; on CPU vLLM compiles one dynamic-shape graph (no per-size compiles).
                "extraArgs": ["--block-size", "32", "--max-num-seqs", "1", "--max-num-batched-tokens", "256"],
            },
            "resources": {"gpus": 0, "memory": "2Gi"},
            "cache": {"bucket": bucket, "artifacts": {"enabled": True}},
        },
    }


def _launch(
    spec: dict[str, Any], workdir: Path, env: dict[str, str], started: list[LauncherProcess]
) -> tuple[dict[str, Any], LauncherProcess]:
    launcher = LauncherProcess(spec, workdir, env)
    started.append(launcher)
    url = f"http://127.0.0.1:{launcher.metrics_port}/coldstart"

    def settled() -> dict[str, Any] | None:
        doc = _get_json(url)
        if not doc or not doc.get("complete"):
            return None
        return doc if doc["artifactsPushed"] or doc["phaseDetails"]["artifacts"]["source"] != "miss" else None

    return wait_until(settled, START_TIMEOUT_S, "vLLM's cold start through the launcher", launcher), launcher


def test_vllms_compile_cache_is_an_artifact_restored_before_the_next_start(
    vllm_installed: None,
    tmp_path: Path,
    s3_client: S3Client,  # noqa: F811
    seaweedfs: SeaweedS3,
    launchers: list[LauncherProcess],  # noqa: F811
) -> None:
    from kvfleet.engine.tiny_model import make_tiny_model

    local = make_tiny_model(tmp_path / "model", layers=1, vocab=1024, **VLLM_TINY_MODEL)
    bucket = f"vllm-cc-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/models/tiny"
    populate(s3_client, local, uri)
    signing_key, keys = tmp_path / "signing.pem", tmp_path / "artifact-keys.pem"
    keys.write_text(public_pem(generate_key_pair(signing_key).public_key()))
    builder = {"KVFLEET_ARTIFACT_SIGNING_KEY": str(signing_key), "KVFLEET_ARTIFACT_KEYS": str(keys)}
    engine_pod = {"KVFLEET_ARTIFACT_KEYS": str(keys)}
    spec = _spec(uri, bucket)

    # vLLM's compile cache key includes the model's path: pods mount the node cache at one path
    # (KVFLEET_NODE_CACHE), so the weights sit at the same <node cache>/models/<digest> on every node.
    node = tmp_path / "node"
    # Without the artifact: the builder's launch compiles and pushes what vLLM built.
    cold, launcher = _launch(spec, tmp_path, launcher_env(seaweedfs, node) | builder, launchers)
    assert cold["phaseDetails"]["artifacts"]["source"] == "miss" and cold["artifactsPushed"] is True, cold
    cold_log = launcher.log
    assert "--enforce-eager" not in cold_log, cold_log[-3000:]
    assert launcher.stop() == 0

    # With it, on a fresh node (the same mount path, nothing on it): restored from the bucket before
    # vLLM starts, and vLLM loads it instead of compiling.
    shutil.rmtree(node)
    warm, launcher = _launch(spec, tmp_path, launcher_env(seaweedfs, node) | engine_pod, launchers)
    artifacts = warm["phaseDetails"]["artifacts"]
    warm_log = launcher.log
    assert launcher.stop() == 0
    assert "Compiling model again" not in warm_log, warm_log[-3000:]
    cold_s, warm_s = cold["phases"]["engine_start"], warm["phases"]["engine_start"]
    cold_compile_s, warm_compile_s = _warmup_s(cold_log), _warmup_s(warm_log)
    print(
        f"vLLM engine_start without the compile cache {cold_s:.1f} s (compile warm-up {cold_compile_s:.0f} s), "
        f"with it {warm_s:.1f} s (warm-up {warm_compile_s:.0f} s); artifacts phase: {json.dumps(artifacts)}"
    )
    assert artifacts["source"] == "bucket" and warm["artifactsFingerprint"] == cold["artifactsFingerprint"], artifacts
    assert artifacts["hit"] is True, f"the launcher's rule did not use it: {artifacts}"
    # Used, so it must pay: the compile from the restored cache is the shorter, and the start faster.
    assert warm_compile_s < cold_compile_s and warm_s < cold_s, (cold_compile_s, warm_compile_s, cold_s, warm_s)
