"""Which artifacts an engine pod loads, with the real store against the real S3 server: only those a
trusted key signed for this fingerprint; anything planted (unsigned, another key, a tampered node
copy) is refused with the reason in the phase log and a metric, and the engine builds locally. An
engine pod holds no signing key, so it never pushes; a trusted builder (the platform's) does."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvfleet.engine_image.cache_sources import CacheArtifacts
from kvfleet.engine_image.launcher import LaunchDeps, Launcher
from kvfleet.engine_image.settings import LauncherSettings
from kvfleet.engine_image.sources import LocalWeights
from kvfleet.weight_cache.artifact_node import NODE_DIR
from kvfleet.weight_cache.s3 import S3Client, S3Uri
from kvfleet.weight_cache.signing import ArtifactSigner, ArtifactTrust
from tests.engine_image.test_launcher import get, make_launch, make_settings, standin, until

PLATFORM = ArtifactSigner(Ed25519PrivateKey.generate())
INTRUDER = ArtifactSigner(Ed25519PrivateKey.generate())
TRUST = ArtifactTrust.of(PLATFORM.public_key(), source="test keys")


@pytest.fixture
def where(s3_client: S3Client) -> str:
    bucket = f"art-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/artifacts"


async def launch(
    tmp_path: Path, model_dir: Path, s3: S3Client, where: str, node: str, signer: ArtifactSigner | None = None
) -> tuple[dict[str, Any], str]:
    """One launch on ``node`` to its first token (and its push, if it pushes); (report, metrics text)."""
    settings = make_settings(tmp_path)
    settings = LauncherSettings(
        **{
            **settings.__dict__,
            "node_cache_dir": tmp_path / node,
            "artifacts_work_root": tmp_path / f"pod-{uuid.uuid4().hex[:6]}",
        }
    )
    # What a crashed earlier run of this container left in the pod's own emptyDir is removed.
    leftover = settings.artifacts_work_dir / "leftover" / "kernel.py"
    leftover.parent.mkdir(parents=True)
    leftover.write_text("stale")
    store = CacheArtifacts(s3, where, TRUST, settings.artifacts_dir, signer)
    deps = LaunchDeps(weights=LocalWeights(tmp_path), artifacts=store, render=standin(), engine_stderr=io.BytesIO())
    launcher = Launcher(make_launch(model_dir, artifacts=True), settings, deps)
    task = asyncio.create_task(launcher.run())
    try:

        async def settled() -> bool:
            report = launcher.report()
            return bool(report["complete"]) and (report["artifactsPushed"] or signer is None)

        await until(settled)
        _, metrics = await get(f"http://127.0.0.1:{settings.metrics_port}/metrics")
        report = launcher.report()
        launcher.handle_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 20) == 0
    finally:
        task.cancel()
        await asyncio.wait({task})
    assert not any(settings.artifacts_work_dir.iterdir())  # the unpacked copy goes with the launch
    return report, metrics


def _objects(s3: S3Client, where: str, key: str) -> tuple[bytes, bytes]:
    uri = S3Uri.parse(where)
    fp_keys = (uri.key(f"{key}.tar"), uri.key(f"{key}.sha256"))
    return tuple(s3.get_object(Bucket=uri.bucket, Key=k)["Body"].read() for k in fp_keys)  # type: ignore[return-value]


async def test_engine_pods_load_what_the_trusted_builder_signed_and_never_push(
    tmp_path: Path, model_dir: Path, s3_client: S3Client, where: str
) -> None:
    built, _ = await launch(tmp_path, model_dir, s3_client, where, "builder-node", signer=PLATFORM)
    assert built["phaseDetails"]["artifacts"]["source"] == "miss" and built["artifactsPushed"] is True
    key = built["artifactsFingerprint"]
    assert json.loads(_objects(s3_client, where, key)[1])["signature"]["keyId"] == PLATFORM.key_id

    # The builder keeps a signed node copy of what it pushed; it is checked like any other.
    again, _ = await launch(tmp_path, model_dir, s3_client, where, "builder-node")
    assert again["phaseDetails"]["artifacts"]["source"] == "node-cache" and again["artifactsPushed"] is False
    first, metrics = await launch(tmp_path, model_dir, s3_client, where, "node-a")
    details = first["phaseDetails"]["artifacts"]
    assert details["source"] == "bucket" and details["hit"] is True and first["artifactsPushed"] is False
    assert "kvfleet_coldstart_artifacts_refused_total{" not in metrics
    second, _ = await launch(tmp_path, model_dir, s3_client, where, "node-a")
    details = second["phaseDetails"]["artifacts"]
    assert (
        details["source"] == "node-cache" and details["reason"] == f"restored (signed by trusted key {PLATFORM.key_id})"
    )


async def test_an_unsigned_artifact_is_refused_with_the_reason_and_the_engine_builds_locally(
    tmp_path: Path, model_dir: Path, s3_client: S3Client, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    built, _ = await launch(tmp_path, model_dir, s3_client, where, "builder-node", signer=PLATFORM)
    key = built["artifactsFingerprint"]
    _, sidecar = _objects(s3_client, where, key)
    # What an engine pod with write credentials could plant: the right sha256 sidecar, no signature.
    unsigned = json.dumps({k: v for k, v in json.loads(sidecar).items() if k != "signature"}).encode()
    uri = S3Uri.parse(where)
    s3_client.put_object(Bucket=uri.bucket, Key=uri.key(f"{key}.sha256"), Body=unsigned)

    report, metrics = await launch(tmp_path, model_dir, s3_client, where, "node-b")
    details = report["phaseDetails"]["artifacts"]
    assert details["hit"] is False and details["source"] == "refused" and details["refused"] == "unsigned"
    assert details["reason"] == f"artifacts/{key}.sha256: the sidecar carries no signature; never loaded"
    assert 'kvfleet_coldstart_artifacts_refused_total{reason="unsigned",where="bucket"} 1.0' in metrics
    assert report["complete"] is True and report["artifactsPushed"] is False  # built locally, not pushed
    assert _objects(s3_client, where, key)[1] == unsigned  # the engine pod wrote nothing


async def test_a_planted_node_copy_is_refused_and_the_signed_one_fetched_again(
    tmp_path: Path, model_dir: Path, s3_client: S3Client, where: str
) -> None:
    built, _ = await launch(tmp_path, model_dir, s3_client, where, "builder-node", signer=PLATFORM)
    await launch(tmp_path, model_dir, s3_client, where, "node-c")  # keeps a node copy
    fp_key = built["artifactsFingerprint"]
    sidecar = tmp_path / "node-c" / "artifacts" / NODE_DIR / f"{fp_key}.sidecar.json"
    # A co-tenant re-signs the copy with its own key after swapping the code.
    doc = json.loads(sidecar.read_bytes())
    doc["signature"] = {"keyId": INTRUDER.key_id, "ed25519": INTRUDER.sign(b"anything")}
    sidecar.write_text(json.dumps(doc))

    report, metrics = await launch(tmp_path, model_dir, s3_client, where, "node-c")
    details = report["phaseDetails"]["artifacts"]
    assert details["nodeRefused"] == "untrusted-key" and f"signed by key {INTRUDER.key_id}" in details["nodeReason"]
    assert details["source"] == "bucket" and details["hit"] is True
    assert 'kvfleet_coldstart_artifacts_refused_total{reason="untrusted-key",where="node"} 1.0' in metrics


def test_engine_pod_settings_hold_no_signing_key_by_default() -> None:
    settings = LauncherSettings.from_env({})
    assert settings.artifact_signing_key_path is None
    assert str(settings.artifact_keys_path) == "/etc/kvfleet/artifact-keys.pem"
    from_pod = LauncherSettings.from_env({"KVFLEET_ARTIFACTS_WORK": "/var/lib/kvfleet/artifacts-work"})
    assert str(from_pod.artifacts_work_dir) == "/var/lib/kvfleet/artifacts-work"
