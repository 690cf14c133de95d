"""Node copies of signed artifacts: kept after a verified fetch, and checked again on every use
(signature over the digest and identity, the bytes hashed), never trusted because they are there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvfleet.weight_cache import push_artifacts
from kvfleet.weight_cache.artifact_node import keep_node_copy, node_paths, restore_node_copy
from kvfleet.weight_cache.artifacts import pull_artifacts
from kvfleet.weight_cache.s3 import S3Client
from kvfleet.weight_cache.signing import ArtifactTrust
from tests.weight_cache.conftest import tree_bytes, write_model
from tests.weight_cache.test_artifacts import INTRUDER, PLATFORM, TRUST, _fp


def _node_with_copy(s3: S3Client, bucket: str, tmp_path: Path) -> tuple[Path, Path]:
    src = write_model(tmp_path / "cache", {"inductor/kernel.py": 3000, "graphs/g.bin": 20_000})
    where = f"s3://{bucket}/artifacts"
    push_artifacts(s3, src, where, _fp(), signer=PLATFORM)
    node = tmp_path / "node" / "artifacts"
    result = pull_artifacts(
        s3,
        where,
        _fp(),
        tmp_path / "pod-a" / "work",
        trust=TRUST,
        keep=lambda tar, offer: keep_node_copy(node, _fp(), tar, offer),
    )
    assert result.hit
    return node, src


def test_a_verified_node_copy_is_restored_into_the_pods_own_directory(
    s3: S3Client, bucket: str, tmp_path: Path
) -> None:
    node, src = _node_with_copy(s3, bucket, tmp_path)
    tar, sidecar = node_paths(node, _fp())
    assert tar.is_file() and json.loads(sidecar.read_bytes())["signature"]["keyId"] == PLATFORM.key_id
    result = restore_node_copy(node, _fp(), TRUST, tmp_path / "pod-b" / "work")
    assert result.hit and result.refusal is None
    assert tree_bytes(tmp_path / "pod-b" / "work") == tree_bytes(src)
    # A node copy of one fingerprint never serves another.
    other = restore_node_copy(node, _fp(tp=2), TRUST, tmp_path / "pod-c" / "work")
    assert not other.hit and other.refusal is None and other.reason == "no copy on this node"


def test_a_tampered_node_copy_is_refused_and_deleted(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    node, _ = _node_with_copy(s3, bucket, tmp_path)
    tar, sidecar = node_paths(node, _fp())
    data = bytearray(tar.read_bytes())
    data[-2000] ^= 0xFF  # a co-tenant flips a byte of a cached kernel on the shared hostPath
    tar.write_bytes(bytes(data))
    result = restore_node_copy(node, _fp(), TRUST, tmp_path / "pod-b" / "work")
    assert not result.hit and result.refusal == "content-mismatch" and "never loaded" in result.reason
    assert not tar.exists() and not sidecar.exists()  # the next launch fetches a good one
    assert not any((tmp_path / "pod-b").rglob("*.py"))


def test_a_planted_node_copy_is_refused(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    node, _ = _node_with_copy(s3, bucket, tmp_path)
    tar, sidecar = node_paths(node, _fp())
    # The old trust signal (a marker file) is not enough any more: an unsigned sidecar is refused.
    planted = {k: v for k, v in json.loads(sidecar.read_bytes()).items() if k != "signature"}
    sidecar.write_text(json.dumps(planted))
    result = restore_node_copy(node, _fp(), TRUST, tmp_path / "pod-b" / "work")
    assert not result.hit and result.refusal == "unsigned" and not tar.exists()

    # Signed by a co-tenant's own key.
    node2, src = _node_with_copy(s3, bucket, tmp_path / "again")
    own = tmp_path / "intruder"
    push_artifacts(s3, src, f"s3://{bucket}/intruder", _fp(), signer=INTRUDER)
    pull_artifacts(
        s3,
        f"s3://{bucket}/intruder",
        _fp(),
        own / "work",
        trust=ArtifactTrust.of(INTRUDER.public_key()),
        keep=lambda t, o: keep_node_copy(own / "node", _fp(), t, o),
    )
    for path, planted_path in zip(node_paths(own / "node", _fp()), node_paths(node2, _fp()), strict=True):
        shutil.copyfile(path, planted_path)
    result = restore_node_copy(node2, _fp(), TRUST, tmp_path / "pod-c" / "work")
    assert not result.hit and result.refusal == "untrusted-key"
