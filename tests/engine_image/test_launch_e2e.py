"""The launcher end to end on CPU: the real `kvfleet engine launch` process, the reference engine,
the real S3 server (SeaweedFS) as the weight cache. A cold launch by the platform's builder (it holds the signing
key) pulls the weights, misses the artifacts and pushes them, signed, after it is ready; a warm
launch as an engine pod (public key only) on the same node hits the node cache for both; a launch
on a fresh node restores the signed artifacts from the bucket and the engine compiles from them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvfleet.weight_cache.s3 import S3Client
from kvfleet.weight_cache.signing import generate_key_pair, public_pem
from kvfleet_testkit.seaweedfs import SeaweedS3
from tests.engine_image.conftest import LauncherProcess, PopulatedModel, launcher_env, wait_until

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 180.0


def get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def complete(launcher: LauncherProcess, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{launcher.engine_port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return dict(json.loads(response.read()))


def spec_for(model: PopulatedModel) -> dict[str, Any]:
    return {
        "name": "tiny",
        "namespace": "default",
        "servedName": "tiny",
        "spec": {
            "model": {"uri": model.uri},
            # One static bucket keeps the compile (three C++ graphs) short; the artifact is its cache.
            "engine": {
                "kind": "reference",
                "maxModelLen": 256,
                "extraArgs": ["--compile", "on", "--compile-mode", "static", "--compile-sizes", "1"],
            },
            "resources": {"gpus": 0},
            "cache": {"bucket": model.bucket, "artifacts": {"enabled": True}},
        },
    }


def launch_and_serve(
    model: PopulatedModel,
    node_cache: Path,
    workdir: Path,
    server: SeaweedS3,
    launchers: list[LauncherProcess],
    env: dict[str, str],
) -> tuple[dict[str, Any], LauncherProcess]:
    """Start a launcher, wait for its cold start to complete and its push (if any) to finish, serve a completion."""
    launcher = LauncherProcess(spec_for(model), workdir, launcher_env(server, node_cache) | env)
    launchers.append(launcher)
    url = f"http://127.0.0.1:{launcher.metrics_port}/coldstart"

    def settled() -> dict[str, Any] | None:
        doc = get_json(url)
        if not doc or not doc.get("complete"):
            return None
        return doc if doc["artifactsPushed"] or doc["phaseDetails"]["artifacts"]["hit"] else None

    report = wait_until(settled, START_TIMEOUT_S, "a complete cold start", launcher)
    answer = complete(launcher, "The launcher pulled")
    assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] >= 1
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{launcher.metrics_port}/metrics", timeout=5).read().decode()
    for phase in ("pull", "artifacts", "engine_start", "first_ready", "total"):
        assert f'kvfleet_coldstart_seconds{{phase="{phase}"}}' in metrics
    return report, launcher


def test_cold_then_warm_then_fresh_node(
    tmp_path: Path,
    populated_model: PopulatedModel,
    seaweedfs: SeaweedS3,
    s3_client: S3Client,
    launchers: list[LauncherProcess],
) -> None:
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    # The platform's builder holds the signing key; engine pods only the public key.
    signing_key = tmp_path / "signing.pem"
    keys = tmp_path / "artifact-keys.pem"
    keys.write_text(public_pem(generate_key_pair(signing_key).public_key()))
    builder = {"KVFLEET_ARTIFACT_SIGNING_KEY": str(signing_key), "KVFLEET_ARTIFACT_KEYS": str(keys)}
    engine_pod = {"KVFLEET_ARTIFACT_KEYS": str(keys)}

    cold, launcher = launch_and_serve(populated_model, node_a, tmp_path, seaweedfs, launchers, builder)
    details = cold["phaseDetails"]
    assert details["pull"]["source"] == "s3" and details["pull"]["bytesFetched"] > 50 << 20
    assert details["artifacts"]["source"] == "miss" and cold["artifactsPushed"] is True
    fingerprint = cold["artifactsFingerprint"]
    keys = {o["Key"] for o in s3_client.list_objects_v2(Bucket=populated_model.bucket)["Contents"]}
    assert {f"artifacts/{fingerprint}.tar", f"artifacts/{fingerprint}.sha256"} <= keys
    # SIGTERM reaches the engine through the launcher; it drains and both exit 0.
    assert launcher.stop() == 0
    log = launcher.log
    assert '"event": "coldstart_phase", "phase": "pull"' in log and '"event": "artifacts_pushed"' in log
    assert "signal_forwarded" in log and "draining" in log
    assert seaweedfs.secret_key not in log

    warm, launcher = launch_and_serve(populated_model, node_a, tmp_path, seaweedfs, launchers, engine_pod)
    details = warm["phaseDetails"]
    assert details["pull"]["source"] == "node-cache" and details["pull"]["bytesFetched"] == 0
    assert details["artifacts"]["hit"] is True and details["artifacts"]["source"] == "node-cache"
    assert warm["artifactsFingerprint"] == fingerprint and warm["modelDigest"] == cold["modelDigest"]
    assert "compile cache" in launcher.log and ": hit (" in launcher.log
    # What the caches save, without timing noise: no weight byte moved (above), and the engine
    # compiled from the restored cache instead of from scratch. (On the real S3 server a 64 MB cold
    # pull takes about as long as the warm start's sha256 check of the same bytes, so the phases'
    # seconds no longer tell the two apart on a busy machine.)
    warm_compile = warm["phaseDetails"]["engine_start"]["compileSeconds"]
    cold_compile = cold["phaseDetails"]["engine_start"]["compileSeconds"]
    assert warm["phaseDetails"]["engine_start"]["compileCacheHit"] is True
    assert cold["phaseDetails"]["engine_start"]["compileCacheHit"] is False and warm_compile < cold_compile
    assert launcher.stop() == 0

    fresh, launcher = launch_and_serve(populated_model, node_b, tmp_path, seaweedfs, launchers, engine_pod)
    assert fresh["phaseDetails"]["pull"]["source"] == "s3"
    assert fresh["phaseDetails"]["artifacts"]["source"] == "bucket" and fresh["artifactsFingerprint"] == fingerprint
    assert fresh["artifactsPushed"] is False
    assert ": hit (" in launcher.log
    assert launcher.stop() == 0
