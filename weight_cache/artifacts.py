"""Engine artifacts (torch.compile caches, CUDA graphs, engine builds) in S3, keyed by fingerprint.

An artifact is ``<prefix>/<key>.tar`` plus ``<prefix>/<key>.sha256`` (JSON: sha256, size, the
full fingerprint and an Ed25519 signature over them, ``signing.py``); the sidecar is written last,
so it marks a complete upload. A pull never crashes the caller on a bad artifact: missing,
corrupt, oversized, unsafe, unsigned, signed by an untrusted key or built for another fingerprint
are all misses, the bad ones with a warning and (for the untrusted ones) a ``refusal``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from kvfleet.weight_cache.errors import ArtifactError, UnsafePathError, WeightCacheError
from kvfleet.weight_cache.fingerprint import Fingerprint
from kvfleet.weight_cache.manifest import sha256_file
from kvfleet.weight_cache.s3 import S3Client, S3Uri, error_code, get_bytes
from kvfleet.weight_cache.safety import check_relative_path
from kvfleet.weight_cache.settings import PullSettings
from kvfleet.weight_cache.signing import ArtifactSigner, ArtifactTrust, Refusal, statement

log = logging.getLogger(__name__)

META_NAME = "kvfleet-artifact.json"
FILES_DIR = "files"
MAX_SIDECAR_BYTES = 64 << 10
# vLLM's compile cache is tens to hundreds of MB; engine builds (TensorRT) a few GB.
DEFAULT_MAX_ARTIFACT_BYTES = 32 << 30


# Artifacts move as one tarball, in the weight pull's parallel ranged parts: the same part size and
# connections in flight as PullSettings (s3transfer's ranged GETs above one part). boto3's default
# 8 MiB parts mean 128 requests per GiB; 32 MiB parts cut the per-request overhead fourfold, and
# servers that read the whole object for every ranged GET (moto) pay it a quarter as often.
def transfer_config(settings: PullSettings | None = None) -> TransferConfig:
    pull = settings or PullSettings()
    return TransferConfig(
        max_concurrency=pull.concurrency,
        multipart_threshold=pull.part_size_bytes,
        multipart_chunksize=pull.part_size_bytes,
    )


_ARTIFACT_TRANSFER = transfer_config()


@dataclass(frozen=True)
class ArtifactPushResult:
    key: str
    size_bytes: int
    sha256: str
    skipped: bool  # an artifact for this fingerprint, signed by this key, was already there
    key_id: str = ""


@dataclass(frozen=True)
class ArtifactOffer:
    """What the bucket (or the node) holds for a fingerprint, read from the sidecar before any
    tarball byte and checked against the trusted keys: enough to decide whether fetching it beats
    rebuilding it. ``refusal`` names why an artifact that is there is never loaded."""

    found: bool
    reason: str
    key: str
    size_bytes: int = 0
    sha256: str = ""
    # The engine's start-up work this artifact replaces, as measured when it was built (None for
    # artifacts pushed without it).
    build_seconds: float | None = None
    warning: bool = False
    refusal: Refusal | None = None
    # The verified sidecar's bytes, kept beside a node copy so the node copy is checked the same way.
    sidecar: bytes = b""


@dataclass(frozen=True)
class ArtifactPullResult:
    hit: bool
    reason: str
    key: str
    size_bytes: int = 0
    warning: bool = False
    refusal: Refusal | None = None


def artifact_keys(uri: S3Uri, fp: Fingerprint) -> tuple[str, str]:
    return uri.key(f"{fp.key}.tar"), uri.key(f"{fp.key}.sha256")


def signed_sidecar(
    fp: Fingerprint, sha256: str, size_bytes: int, build_seconds: float | None, signer: ArtifactSigner
) -> bytes:
    """The sidecar a trusted writer stores: content digest, identity, and its signature over both."""
    build = round(build_seconds, 4) if build_seconds is not None else None
    doc: dict[str, object] = {"sha256": sha256, "sizeBytes": size_bytes, "fingerprint": fp.to_wire()}
    if build is not None:
        doc["buildSeconds"] = build
    doc["signature"] = {"keyId": signer.key_id, "ed25519": signer.sign(statement(fp, sha256, size_bytes, build))}
    return json.dumps(doc, sort_keys=True).encode()


def check_sidecar(
    raw: bytes, fp: Fingerprint, trust: ArtifactTrust, *, where: str, max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES
) -> ArtifactOffer:
    """Whether the sidecar ``raw`` offers a loadable artifact for ``fp``: well formed, built for
    ``fp``, not too large, and signed over its digest and ``fp`` by a trusted key. Pure."""

    def miss(reason: str, refusal: Refusal | None, size: int = 0) -> ArtifactOffer:
        return ArtifactOffer(found=False, reason=reason, key=fp.key, size_bytes=size, warning=True, refusal=refusal)

    try:
        sidecar = json.loads(raw)
        want_sha, size = str(sidecar["sha256"]), int(sidecar["sizeBytes"])
        stored_fp = sidecar["fingerprint"]
        build = sidecar.get("buildSeconds")
        build_seconds = float(build) if build is not None else None
    except (ValueError, KeyError, TypeError):
        return miss(f"{where} is not a valid checksum file", None)
    if stored_fp != fp.to_wire():
        return miss(f"{where} was built for a different fingerprint; never loaded", "identity-mismatch")
    if size > max_bytes:
        return miss(f"artifact is {size} bytes, more than the {max_bytes} accepted", None, size)
    verdict = trust.verify(statement(fp, want_sha, size, build_seconds), sidecar.get("signature"))
    if verdict.refusal is not None:
        return miss(f"{where}: {verdict.reason}; never loaded", verdict.refusal, size)
    return ArtifactOffer(
        found=True,
        reason=verdict.reason,
        key=fp.key,
        size_bytes=size,
        sha256=want_sha,
        build_seconds=build_seconds,
        sidecar=raw,
    )


def push_artifacts(
    client: S3Client,
    src_dir: Path,
    location_uri: str,
    fp: Fingerprint,
    *,
    signer: ArtifactSigner,
    overwrite: bool = False,
    max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
    build_seconds: float | None = None,
    transfer: TransferConfig = _ARTIFACT_TRANSFER,
    keep: Callable[[Path, ArtifactOffer], None] | None = None,
) -> ArtifactPushResult:
    """Tar ``src_dir`` (regular files and directories only), upload it under ``fp``'s key and sign
    it. An artifact already there and signed by ``signer`` is kept; anything else there (unsigned,
    another key, another identity) is replaced. ``keep(tar, offer)`` gets the signed tarball
    before it is deleted (a builder keeps a node copy)."""
    uri = S3Uri.parse(location_uri)
    tar_key, sum_key = artifact_keys(uri, fp)
    if not src_dir.is_dir():
        raise ArtifactError(f"{src_dir}: not a directory")
    try:
        existing = get_bytes(client, uri.bucket, sum_key, MAX_SIDECAR_BYTES)
        if existing is not None and not overwrite:
            mine = check_sidecar(existing, fp, ArtifactTrust.of(signer.public_key()), where=sum_key)
            if mine.found:
                return ArtifactPushResult(
                    key=fp.key, size_bytes=mine.size_bytes, sha256=mine.sha256, skipped=True, key_id=signer.key_id
                )
        with tempfile.TemporaryDirectory(prefix="kvfleet-artifact-") as tmp:
            tar_path = Path(tmp) / "artifact.tar"
            _write_tar(src_dir, tar_path, fp)
            size = tar_path.stat().st_size
            if size > max_bytes:
                raise ArtifactError(f"{src_dir}: artifact is {size} bytes, more than the {max_bytes} allowed")
            digest = sha256_file(tar_path)
            client.upload_file(str(tar_path), uri.bucket, tar_key, Config=transfer)
            body = signed_sidecar(fp, digest, size, build_seconds, signer)
            client.put_object(Bucket=uri.bucket, Key=sum_key, Body=body)
            if keep is not None:
                offer = ArtifactOffer(
                    found=True, reason="pushed", key=fp.key, size_bytes=size, sha256=digest, sidecar=body
                )
                keep(tar_path, offer)
    except (ClientError, BotoCoreError) as e:
        raise ArtifactError(f"push of artifact {fp.key} to {uri} failed: {e}") from e
    return ArtifactPushResult(key=fp.key, size_bytes=size, sha256=digest, skipped=False, key_id=signer.key_id)


def _write_tar(src_dir: Path, tar_path: Path, fp: Fingerprint) -> None:
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        meta = json.dumps(fp.to_wire(), sort_keys=True).encode()
        info = tarfile.TarInfo(META_NAME)
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
        for dirpath, dirnames, filenames in os.walk(src_dir):
            dirnames.sort()
            for name in sorted([*dirnames, *filenames]):
                path = Path(dirpath) / name
                rel = path.relative_to(src_dir).as_posix()
                if path.is_symlink():
                    raise ArtifactError(f"{rel}: symlinks are not stored in artifacts")
                if not (path.is_file() or path.is_dir()):
                    raise ArtifactError(f"{rel}: only regular files and directories are stored in artifacts")
                check_relative_path(rel)
                member = tar.gettarinfo(str(path), arcname=f"{FILES_DIR}/{rel}")
                member.uid = member.gid = 0
                member.uname = member.gname = ""
                if path.is_file():
                    with path.open("rb") as f:
                        tar.addfile(member, f)
                else:
                    tar.addfile(member)


def describe_artifact(
    client: S3Client,
    location_uri: str,
    fp: Fingerprint,
    *,
    trust: ArtifactTrust,
    max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
) -> ArtifactOffer:
    """Read and check ``fp``'s sidecar: found (signed, with size and build time), or why not.
    Never raises on a bad artifact."""
    uri = S3Uri.parse(location_uri)
    _, sum_key = artifact_keys(uri, fp)
    try:
        raw = get_bytes(client, uri.bucket, sum_key, MAX_SIDECAR_BYTES)
    except (ClientError, BotoCoreError) as e:
        offer = ArtifactOffer(found=False, reason=f"cannot read {sum_key}: {e}", key=fp.key, warning=True)
    else:
        if raw is None:
            return ArtifactOffer(found=False, reason="no artifact for this fingerprint", key=fp.key)
        offer = check_sidecar(raw, fp, trust, where=sum_key, max_bytes=max_bytes)
    if offer.warning:
        log.warning("artifact %s ignored: %s", fp.key, offer.reason)
    return offer


def restore_verified(
    tar_path: Path, offer: ArtifactOffer, fp: Fingerprint, dest: Path, *, max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES
) -> ArtifactPullResult:
    """Unpack ``tar_path`` (a copy no one else can write) into ``dest`` (absent or empty) if its
    bytes hash to the digest ``offer``'s verified signature covers. A hit or a refusal, with why."""

    def miss(reason: str, refusal: Refusal | None) -> ArtifactPullResult:
        log.warning("artifact %s ignored: %s", fp.key, reason)
        return ArtifactPullResult(
            hit=False, reason=reason, key=fp.key, size_bytes=offer.size_bytes, warning=True, refusal=refusal
        )

    got_sha = sha256_file(tar_path)
    if got_sha != offer.sha256 or tar_path.stat().st_size != offer.size_bytes:
        return miss(
            f"tarball is corrupt or tampered (sha256 {got_sha}, the signed digest is {offer.sha256}); never loaded",
            "content-mismatch",
        )
    extract_root = tar_path.parent / "extract"
    try:
        _safe_extract(tar_path, extract_root, fp, max_bytes)
    except (tarfile.TarError, OSError, WeightCacheError, ValueError) as e:
        return miss(f"tarball refused: {e}", None)
    files = extract_root / FILES_DIR
    files.mkdir(exist_ok=True)
    if dest.exists():
        dest.rmdir()  # empty, checked by the caller
    os.replace(files, dest)
    return ArtifactPullResult(hit=True, reason=f"restored ({offer.reason})", key=fp.key, size_bytes=offer.size_bytes)


def check_dest(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ArtifactError(f"{dest}: artifacts are restored into an absent or empty directory")


def pull_artifacts(
    client: S3Client,
    location_uri: str,
    fp: Fingerprint,
    dest: Path,
    *,
    trust: ArtifactTrust,
    max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
    offer: ArtifactOffer | None = None,
    transfer: TransferConfig = _ARTIFACT_TRANSFER,
    keep: Callable[[Path, ArtifactOffer], None] | None = None,
) -> ArtifactPullResult:
    """Restore the artifact for ``fp`` into ``dest`` (absent or empty) if a trusted key signed it
    and its bytes match. A hit or a miss, with why. ``offer`` is :func:`describe_artifact`'s answer
    when the caller already read the sidecar; ``keep(tar, offer)`` is called with the verified
    tarball before it is deleted (the launcher keeps a node copy)."""
    uri = S3Uri.parse(location_uri)
    tar_key, _ = artifact_keys(uri, fp)
    check_dest(dest)
    if offer is None:
        offer = describe_artifact(client, location_uri, fp, trust=trust, max_bytes=max_bytes)
    if not offer.found:
        return ArtifactPullResult(
            hit=False,
            reason=offer.reason,
            key=fp.key,
            size_bytes=offer.size_bytes,
            warning=offer.warning,
            refusal=offer.refusal,
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kvfleet-artifact-", dir=dest.parent) as tmp:
        tar_path = Path(tmp) / "artifact.tar"
        try:
            client.download_file(uri.bucket, tar_key, str(tar_path), Config=transfer)
        except (ClientError, BotoCoreError) as e:
            reason = f"cannot download {tar_key}: {error_code(e) if isinstance(e, ClientError) else e}"
            log.warning("artifact %s ignored: %s", fp.key, reason)
            return ArtifactPullResult(hit=False, reason=reason, key=fp.key, warning=True)
        result = restore_verified(tar_path, offer, fp, dest, max_bytes=max_bytes)
        if result.hit and keep is not None:
            keep(tar_path, offer)
    return result


def _safe_extract(tar_path: Path, into: Path, fp: Fingerprint, max_bytes: int) -> None:
    with tarfile.open(tar_path, "r:") as tar:
        members = tar.getmembers()
        total = 0
        meta_seen = False
        for member in members:
            if member.name == META_NAME and member.isfile():
                data = tar.extractfile(member)
                if data is None or json.loads(data.read()) != fp.to_wire():
                    raise ArtifactError("the tarball's own fingerprint differs from the one asked for")
                meta_seen = True
                continue
            top, _, rest = member.name.partition("/")
            if top != FILES_DIR or not rest:
                raise UnsafePathError(f"{member.name}: unexpected member")
            check_relative_path(rest)
            if not (member.isfile() or member.isdir()):
                raise UnsafePathError(f"{member.name}: links and devices are not restored")
            total += member.size
            if total > max_bytes:
                raise ArtifactError(f"unpacks to more than {max_bytes} bytes")
        if not meta_seen:
            raise ArtifactError(f"no {META_NAME} in the tarball")
        into.mkdir()
        # The "data" filter re-checks every member (no absolute paths, links out, device files).
        tar.extractall(into, members=[m for m in members if m.name != META_NAME], filter="data")
