"""Engine artifacts keyed by fingerprint, against moto's S3 server: hits, clean misses, and bad
artifacts that are misses with a warning instead of crashes."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tarfile
from pathlib import Path

import pytest

from kvfleet.weight_cache import Accelerator, ArtifactError, Fingerprint, fingerprint, pull_artifacts, push_artifacts
from kvfleet.weight_cache.artifacts import artifact_keys, describe_artifact, transfer_config
from kvfleet.weight_cache.s3 import S3Client, S3Uri
from kvfleet.weight_cache.settings import PullSettings
from tests.weight_cache.conftest import tree_bytes, write_model

H100 = Accelerator(gpu_product="NVIDIA-H100-80GB-HBM3", cuda_version="12.4", driver_version="550.54.15", device_count=1)


def _fp(tp: int = 1, **kwargs: object) -> Fingerprint:
    args = dict(
        engine_name="vllm",
        engine_version="0.8.0",
        model_digest="c" * 64,
        accelerator=H100,
        tensor_parallel_size=tp,
        dtype="bfloat16",
        engine_args=["--max-model-len", "4096"],
    )
    args.update(kwargs)
    return fingerprint(**args)  # type: ignore[arg-type]


@pytest.fixture
def compile_cache(tmp_path: Path) -> Path:
    return write_model(
        tmp_path / "torch_compile_cache",
        {"rank_0_0/backbone/inductor_cache/abc.py": 2000, "rank_0_0/cache_key": 64, "graphs/capture.bin": 50_000},
    )


def test_push_then_pull_is_a_hit(s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path) -> None:
    where = f"s3://{bucket}/artifacts"
    pushed = push_artifacts(s3, compile_cache, where, _fp())
    assert not pushed.skipped and pushed.key == _fp().key
    assert push_artifacts(s3, compile_cache, where, _fp()).skipped  # first writer wins

    result = pull_artifacts(s3, where, _fp(), tmp_path / "restored")
    assert result.hit and not result.warning and result.size_bytes == pushed.size_bytes
    assert tree_bytes(tmp_path / "restored") == tree_bytes(compile_cache)


def test_the_sidecar_says_what_the_artifact_replaces_before_any_tarball_byte(
    s3: S3Client, bucket: str, compile_cache: Path
) -> None:
    where = f"s3://{bucket}/artifacts"
    absent = describe_artifact(s3, where, _fp())
    assert not absent.found and absent.reason == "no artifact for this fingerprint"
    pushed = push_artifacts(s3, compile_cache, where, _fp(), build_seconds=42.123456)
    offer = describe_artifact(s3, where, _fp())
    assert offer.found and offer.size_bytes == pushed.size_bytes and offer.sha256 == pushed.sha256
    assert offer.build_seconds == 42.1235
    # Another torch or device capability is another fingerprint: not offered.
    assert not describe_artifact(s3, where, _fp(torch_version="2.12.0")).found


def test_an_artifact_moves_in_parallel_ranged_parts_like_weights(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    big = write_model(tmp_path / "cache", {"inductor/kernels.so": 700_000, "inductor/graph.py": 1000})
    where = f"s3://{bucket}/artifacts"
    small_parts = transfer_config(PullSettings(part_size_bytes=256 * 1024, concurrency=4))
    push_artifacts(s3, big, where, _fp(), transfer=small_parts)
    ranges: list[str] = []

    def record(request: object, **_: object) -> None:
        headers = getattr(request, "headers", {})
        if str(getattr(request, "url", "")).endswith(".tar") and "Range" in headers:
            value = headers["Range"]
            ranges.append(value.decode() if isinstance(value, bytes) else str(value))

    s3.meta.events.register("before-send.s3.GetObject", record)
    try:
        result = pull_artifacts(s3, where, _fp(), tmp_path / "restored", transfer=small_parts)
    finally:
        s3.meta.events.unregister("before-send.s3.GetObject", record)
    assert result.hit and tree_bytes(tmp_path / "restored") == tree_bytes(big)
    # About 700 kB in 256 KiB parts: three ranged GETs, not one stream.
    assert len(ranges) == 3 and all(r.startswith("bytes=") for r in ranges)


def test_fingerprint_mismatch_is_a_clean_miss(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    where = f"s3://{bucket}/artifacts"
    push_artifacts(s3, compile_cache, where, _fp(tp=1))
    with caplog.at_level(logging.WARNING):
        for other in (_fp(tp=2), _fp(dtype="float16"), _fp(engine_args=["--max-model-len", "8192"])):
            result = pull_artifacts(s3, where, other, tmp_path / "dest")
            assert not result.hit and not result.warning and result.reason == "no artifact for this fingerprint"
    assert not (tmp_path / "dest").exists() and caplog.text == ""


def test_corrupt_tarball_is_a_miss_with_a_warning(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    where = f"s3://{bucket}/artifacts"
    push_artifacts(s3, compile_cache, where, _fp())
    tar_key, _ = artifact_keys(S3Uri.parse(where), _fp())
    s3.put_object(Bucket=bucket, Key=tar_key, Body=b"not a tarball at all")
    with caplog.at_level(logging.WARNING):
        result = pull_artifacts(s3, where, _fp(), tmp_path / "dest")
    assert not result.hit and result.warning and "corrupt" in result.reason
    assert "corrupt" in caplog.text and not (tmp_path / "dest").exists()


def test_sidecar_for_another_fingerprint_is_never_loaded(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    where = f"s3://{bucket}/artifacts"
    _, sum_key = artifact_keys(S3Uri.parse(where), _fp())
    # An object under our key that says it was built for tp=2 (a bug, a hash collision, tampering).
    s3.put_object(
        Bucket=bucket,
        Key=sum_key,
        Body=json.dumps({"sha256": "0" * 64, "sizeBytes": 1, "fingerprint": _fp(2).to_wire()}),
    )
    result = pull_artifacts(s3, where, _fp(), tmp_path / "dest")
    assert not result.hit and result.warning and "different fingerprint" in result.reason
    s3.put_object(Bucket=bucket, Key=sum_key, Body=b"{not json")
    assert pull_artifacts(s3, where, _fp(), tmp_path / "dest").warning


def _tar_with(members: dict[str, bytes], fp: Fingerprint) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in {"kvfleet-artifact.json": json.dumps(fp.to_wire()).encode(), **members}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_path_traversal_in_an_artifact_is_refused(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    where = f"s3://{bucket}/artifacts"
    tar_key, sum_key = artifact_keys(S3Uri.parse(where), _fp())
    for evil in ("files/../../escaped.txt", "/etc/escaped.txt", "escaped.txt"):
        body = _tar_with({evil: b"gotcha"}, _fp())
        s3.put_object(Bucket=bucket, Key=tar_key, Body=body)
        sidecar = {"sha256": hashlib.sha256(body).hexdigest(), "sizeBytes": len(body), "fingerprint": _fp().to_wire()}
        s3.put_object(Bucket=bucket, Key=sum_key, Body=json.dumps(sidecar))
        result = pull_artifacts(s3, where, _fp(), tmp_path / "work" / "dest")
        assert not result.hit and result.warning and "refused" in result.reason, evil
    assert list(tmp_path.rglob("escaped.txt")) == []


def test_push_refuses_symlinks_and_pull_needs_an_empty_dest(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path
) -> None:
    (compile_cache / "link").symlink_to("/etc/hostname")
    with pytest.raises(ArtifactError, match="symlink"):
        push_artifacts(s3, compile_cache, f"s3://{bucket}/a", _fp())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ArtifactError, match="empty"):
        pull_artifacts(s3, f"s3://{bucket}/a", _fp(), tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"
