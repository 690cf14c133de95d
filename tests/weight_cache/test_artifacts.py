"""Engine artifacts keyed by fingerprint, against a real S3 server (SeaweedFS): signed hits, clean misses, bad
artifacts that are misses with a warning instead of crashes, and planted ones (unsigned, another
key, tampered, replayed under another identity) that are refused with the reason."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tarfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvfleet.weight_cache import Accelerator, ArtifactError, Fingerprint, fingerprint, push_artifacts
from kvfleet.weight_cache import pull_artifacts as _pull
from kvfleet.weight_cache.artifacts import (
    ArtifactPullResult,
    artifact_keys,
    describe_artifact,
    signed_sidecar,
    transfer_config,
)
from kvfleet.weight_cache.s3 import S3Client, S3Uri
from kvfleet.weight_cache.settings import PullSettings
from kvfleet.weight_cache.signing import ArtifactSigner, ArtifactTrust
from tests.weight_cache.conftest import tree_bytes, write_model

# The trusted writer's key (the platform's), and a key a co-tenant made for itself.
PLATFORM = ArtifactSigner(Ed25519PrivateKey.generate())
INTRUDER = ArtifactSigner(Ed25519PrivateKey.generate())
TRUST = ArtifactTrust.of(PLATFORM.public_key(), source="test keys")

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


def pull_artifacts(client: S3Client, where: str, fp: Fingerprint, dest: Path, **kwargs: object) -> ArtifactPullResult:
    kwargs.setdefault("trust", TRUST)
    return _pull(client, where, fp, dest, **kwargs)  # type: ignore[arg-type]


def push(client: S3Client, src: Path, where: str, fp: Fingerprint, **kwargs: object) -> object:
    kwargs.setdefault("signer", PLATFORM)
    return push_artifacts(client, src, where, fp, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def compile_cache(tmp_path: Path) -> Path:
    return write_model(
        tmp_path / "torch_compile_cache",
        {"rank_0_0/backbone/inductor_cache/abc.py": 2000, "rank_0_0/cache_key": 64, "graphs/capture.bin": 50_000},
    )


def test_push_then_pull_is_a_hit(s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path) -> None:
    where = f"s3://{bucket}/artifacts"
    pushed = push_artifacts(s3, compile_cache, where, _fp(), signer=PLATFORM)
    assert not pushed.skipped and pushed.key == _fp().key
    assert push_artifacts(s3, compile_cache, where, _fp(), signer=PLATFORM).skipped  # signed by us: kept

    result = pull_artifacts(s3, where, _fp(), tmp_path / "restored")
    assert result.hit and not result.warning and result.size_bytes == pushed.size_bytes
    assert tree_bytes(tmp_path / "restored") == tree_bytes(compile_cache)


def test_the_sidecar_says_what_the_artifact_replaces_before_any_tarball_byte(
    s3: S3Client, bucket: str, compile_cache: Path
) -> None:
    where = f"s3://{bucket}/artifacts"
    absent = describe_artifact(s3, where, _fp(), trust=TRUST)
    assert not absent.found and absent.reason == "no artifact for this fingerprint"
    pushed = push_artifacts(s3, compile_cache, where, _fp(), signer=PLATFORM, build_seconds=42.123456)
    offer = describe_artifact(s3, where, _fp(), trust=TRUST)
    assert offer.found and offer.size_bytes == pushed.size_bytes and offer.sha256 == pushed.sha256
    assert offer.build_seconds == 42.1235
    # Another torch or device capability is another fingerprint: not offered.
    assert not describe_artifact(s3, where, _fp(torch_version="2.12.0"), trust=TRUST).found


def test_an_artifact_moves_in_parallel_ranged_parts_like_weights(s3: S3Client, bucket: str, tmp_path: Path) -> None:
    big = write_model(tmp_path / "cache", {"inductor/kernels.so": 700_000, "inductor/graph.py": 1000})
    where = f"s3://{bucket}/artifacts"
    small_parts = transfer_config(PullSettings(part_size_bytes=256 * 1024, concurrency=4))
    push(s3, big, where, _fp(), transfer=small_parts)
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
    push(s3, compile_cache, where, _fp(tp=1))
    with caplog.at_level(logging.WARNING):
        for other in (_fp(tp=2), _fp(dtype="float16"), _fp(engine_args=["--max-model-len", "8192"])):
            result = pull_artifacts(s3, where, other, tmp_path / "dest")
            assert not result.hit and not result.warning and result.reason == "no artifact for this fingerprint"
    assert not (tmp_path / "dest").exists() and caplog.text == ""


def test_corrupt_tarball_is_a_miss_with_a_warning(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    where = f"s3://{bucket}/artifacts"
    push(s3, compile_cache, where, _fp())
    tar_key, _ = artifact_keys(S3Uri.parse(where), _fp())
    s3.put_object(Bucket=bucket, Key=tar_key, Body=b"not a tarball at all")
    with caplog.at_level(logging.WARNING):
        result = pull_artifacts(s3, where, _fp(), tmp_path / "dest")
    assert not result.hit and result.warning and "corrupt" in result.reason and result.refusal == "content-mismatch"
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
    assert result.refusal == "identity-mismatch"
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
        # Signed by the trusted key: the unpacking's own checks still refuse it.
        s3.put_object(
            Bucket=bucket,
            Key=sum_key,
            Body=signed_sidecar(_fp(), hashlib.sha256(body).hexdigest(), len(body), None, PLATFORM),
        )
        result = pull_artifacts(s3, where, _fp(), tmp_path / "work" / "dest")
        assert not result.hit and result.warning and "refused" in result.reason, evil
    assert list(tmp_path.rglob("escaped.txt")) == []


def test_push_refuses_symlinks_and_pull_needs_an_empty_dest(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path
) -> None:
    (compile_cache / "link").symlink_to("/etc/hostname")
    with pytest.raises(ArtifactError, match="symlink"):
        push(s3, compile_cache, f"s3://{bucket}/a", _fp())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ArtifactError, match="empty"):
        pull_artifacts(s3, f"s3://{bucket}/a", _fp(), tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"


# -- planted artifacts: never loaded, with the reason --------------------------------------------


def _plant(s3: S3Client, bucket: str, fp: Fingerprint, tar: bytes, sidecar: bytes, where: str = "artifacts") -> None:
    tar_key, sum_key = artifact_keys(S3Uri.parse(f"s3://{bucket}/{where}"), fp)
    s3.put_object(Bucket=bucket, Key=tar_key, Body=tar)
    s3.put_object(Bucket=bucket, Key=sum_key, Body=sidecar)


def _objects(s3: S3Client, bucket: str, fp: Fingerprint) -> tuple[bytes, bytes]:
    tar_key, sum_key = artifact_keys(S3Uri.parse(f"s3://{bucket}/artifacts"), fp)
    get = lambda key: s3.get_object(Bucket=bucket, Key=key)["Body"].read()  # noqa: E731
    return get(tar_key), get(sum_key)


def test_a_signed_artifact_loads_and_names_the_key(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path
) -> None:
    where = f"s3://{bucket}/artifacts"
    pushed = push_artifacts(s3, compile_cache, where, _fp(), signer=PLATFORM)
    assert pushed.key_id == PLATFORM.key_id
    sidecar = json.loads(_objects(s3, bucket, _fp())[1])
    assert sidecar["signature"]["keyId"] == PLATFORM.key_id and sidecar["signature"]["ed25519"]
    result = pull_artifacts(s3, where, _fp(), tmp_path / "restored")
    assert result.hit and result.refusal is None and f"signed by trusted key {PLATFORM.key_id}" in result.reason
    assert tree_bytes(tmp_path / "restored") == tree_bytes(compile_cache)


def test_an_unsigned_artifact_is_refused_with_the_reason(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What an engine pod with write credentials could upload: a correct sha256 sidecar, no signature.
    push_artifacts(s3, compile_cache, f"s3://{bucket}/artifacts", _fp(), signer=PLATFORM)
    tar, signed = _objects(s3, bucket, _fp())
    unsigned = {k: v for k, v in json.loads(signed).items() if k != "signature"}
    _plant(s3, bucket, _fp(), tar, json.dumps(unsigned).encode())
    with caplog.at_level(logging.WARNING):
        result = pull_artifacts(s3, f"s3://{bucket}/artifacts", _fp(), tmp_path / "dest")
    assert not result.hit and result.refusal == "unsigned"
    assert result.reason == f"artifacts/{_fp().key}.sha256: the sidecar carries no signature; never loaded"
    assert "never loaded" in caplog.text and not (tmp_path / "dest").exists()


def test_an_artifact_signed_by_another_key_is_refused(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path
) -> None:
    where = f"s3://{bucket}/artifacts"
    push_artifacts(s3, compile_cache, where, _fp(), signer=INTRUDER)
    result = pull_artifacts(s3, where, _fp(), tmp_path / "dest")
    assert not result.hit and result.refusal == "untrusted-key"
    assert f"signed by key {INTRUDER.key_id}, which is not trusted (trusted: {PLATFORM.key_id})" in result.reason
    # The same artifact with no trusted key configured at all: nothing is loaded unverified.
    nothing = pull_artifacts(s3, where, _fp(), tmp_path / "dest", trust=ArtifactTrust())
    assert not nothing.hit and nothing.refusal == "no-trust" and "no artifact is loaded unverified" in nothing.reason


def test_artifact_bytes_tampered_after_signing_are_refused(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path
) -> None:
    where = f"s3://{bucket}/artifacts"
    push_artifacts(s3, compile_cache, where, _fp(), signer=PLATFORM)
    tar, sidecar = _objects(s3, bucket, _fp())
    evil = _tar_with({"files/rank_0_0/cache_key": b"x" * 64}, _fp())
    # Same size as the signed tarball, so only the digest can tell.
    evil = (evil + b"\0" * len(tar))[: len(tar)]
    _plant(s3, bucket, _fp(), evil, sidecar)
    result = pull_artifacts(s3, where, _fp(), tmp_path / "dest")
    assert not result.hit and result.refusal == "content-mismatch" and "the signed digest is" in result.reason
    # Rewriting the sidecar's digest to match the new bytes breaks the signature instead.
    forged = json.loads(sidecar) | {"sha256": hashlib.sha256(evil).hexdigest()}
    _plant(s3, bucket, _fp(), evil, json.dumps(forged).encode())
    result = pull_artifacts(s3, where, _fp(), tmp_path / "dest")
    assert not result.hit and result.refusal == "bad-signature"
    assert f"the signature by {PLATFORM.key_id} does not match" in result.reason
    assert not (tmp_path / "dest").exists()


def test_a_signed_artifact_replayed_under_another_identity_is_refused(
    s3: S3Client, bucket: str, compile_cache: Path, tmp_path: Path
) -> None:
    where = f"s3://{bucket}/artifacts"
    push_artifacts(s3, compile_cache, where, _fp(tp=1), signer=PLATFORM)
    tar, sidecar = _objects(s3, bucket, _fp(tp=1))
    other = _fp(tp=1, model_digest="e" * 64)  # another model's key
    _plant(s3, bucket, other, tar, sidecar)
    result = pull_artifacts(s3, where, other, tmp_path / "dest")
    assert not result.hit and result.refusal == "identity-mismatch" and "different fingerprint" in result.reason
    # The sidecar edited to claim the other identity: the signature covers the identity.
    _plant(s3, bucket, other, tar, json.dumps(json.loads(sidecar) | {"fingerprint": other.to_wire()}).encode())
    result = pull_artifacts(s3, where, other, tmp_path / "dest")
    assert not result.hit and result.refusal == "bad-signature"
    assert not (tmp_path / "dest").exists()


def test_a_trusted_push_replaces_a_planted_artifact(s3: S3Client, bucket: str, compile_cache: Path) -> None:
    where = f"s3://{bucket}/artifacts"
    push_artifacts(s3, compile_cache, where, _fp(), signer=INTRUDER)
    assert not push_artifacts(s3, compile_cache, where, _fp(), signer=PLATFORM).skipped
    assert describe_artifact(s3, where, _fp(), trust=TRUST).found


def test_the_trusted_keys_file_is_bounded_and_names_bad_keys(tmp_path: Path) -> None:
    from kvfleet.weight_cache.signing import public_pem

    assert ArtifactTrust.from_file(tmp_path / "absent.pem").keys == ()
    good = public_pem(PLATFORM.public_key()) + public_pem(INTRUDER.public_key())
    (tmp_path / "two.pem").write_text(good)
    assert ArtifactTrust.from_file(tmp_path / "two.pem").key_ids == (PLATFORM.key_id, INTRUDER.key_id)
    (tmp_path / "many.pem").write_text(public_pem(PLATFORM.public_key()) * 9)
    with pytest.raises(ArtifactError, match="9 keys, more than the 8 allowed"):
        ArtifactTrust.from_file(tmp_path / "many.pem")
    (tmp_path / "junk.pem").write_text("-----BEGIN PUBLIC KEY-----\nbm90IGEga2V5\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ArtifactError, match="key 1 is not a valid PEM public key"):
        ArtifactTrust.from_file(tmp_path / "junk.pem")
