"""``populate``: upload a model (local directory or hf://) plus its manifest to S3. Idempotent:
objects already there with the same size and sha256 (kept in the object's metadata) are skipped;
the manifest goes last, so a manifest on the server means every file it lists is there too."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import BotoCoreError, ClientError
from s3transfer.subscribers import BaseSubscriber

from kvfleet.weight_cache.errors import InvalidLocationError, SourceUnavailableError, TransferError
from kvfleet.weight_cache.hf_source import fetch_hf_snapshot
from kvfleet.weight_cache.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestFile, build_manifest
from kvfleet.weight_cache.progress import NullProgress, TransferProgress, throughput_line
from kvfleet.weight_cache.s3 import S3Client, S3Uri, error_code, get_bytes, is_not_found
from kvfleet.weight_cache.settings import PopulateSettings

SHA256_METADATA = "sha256"


@dataclass(frozen=True)
class PopulateResult:
    uri: S3Uri
    digest: str
    manifest: Manifest
    uploaded_files: int
    skipped_files: int
    uploaded_bytes: int
    manifest_written: bool
    elapsed_s: float

    def throughput_line(self) -> str:
        extra = f"{self.uploaded_files} files uploaded, {self.skipped_files} already there"
        return throughput_line("uploaded", self.uploaded_bytes, self.elapsed_s, extra)


class _Subscriber(BaseSubscriber):
    def __init__(self, progress: TransferProgress) -> None:
        self._progress = progress

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._progress.on_bytes(bytes_transferred)


def _already_there(client: S3Client, uri: S3Uri, entry: ManifestFile) -> bool:
    try:
        head = client.head_object(Bucket=uri.bucket, Key=uri.key(entry.path))
    except ClientError as e:
        if is_not_found(e):
            return False
        raise TransferError(entry.path, f"HEAD failed: {error_code(e)}") from e
    return bool(
        head["ContentLength"] == entry.size_bytes and head.get("Metadata", {}).get(SHA256_METADATA) == entry.sha256
    )


def populate(
    client: S3Client,
    source: str | Path,
    dest_uri: str,
    settings: PopulateSettings | None = None,
    *,
    progress: TransferProgress | None = None,
    model_id: str | None = None,
    revision: str | None = None,
    hf_endpoint: str | None = None,
    hf_token_file: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> PopulateResult:
    """Upload ``source`` (a directory, or ``hf://org/name@revision``) to ``dest_uri``."""
    settings = settings or PopulateSettings()
    uri = S3Uri.parse(dest_uri)
    text = str(source)
    if text.startswith("hf://"):
        with tempfile.TemporaryDirectory(prefix="kvfleet-hf-") as tmp:
            snap = fetch_hf_snapshot(
                text, Path(tmp), allow_pickle=settings.allow_pickle, endpoint=hf_endpoint, token_file=hf_token_file
            )
            return _populate_dir(
                client, snap.path, uri, settings, progress, model_id or snap.repo_id, snap.revision, clock
            )
    if "://" in text and not text.startswith("file://"):
        raise InvalidLocationError(f"{text!r}: populate reads a local directory or hf://org/name[@revision]")
    src = Path(text.removeprefix("file://"))
    if not src.is_dir():
        raise SourceUnavailableError(f"{src}: no such directory")
    return _populate_dir(client, src, uri, settings, progress, model_id or src.resolve().name, revision, clock)


def _populate_dir(
    client: S3Client,
    src: Path,
    uri: S3Uri,
    settings: PopulateSettings,
    progress: TransferProgress | None,
    model_id: str,
    revision: str | None,
    clock: Callable[[], float],
) -> PopulateResult:
    progress = progress or NullProgress()
    started = clock()
    manifest = build_manifest(
        src, model_id=model_id, revision=revision, allow_pickle=settings.allow_pickle, exclude=settings.exclude
    )
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        present = list(pool.map(lambda e: _already_there(client, uri, e), manifest.files))
    todo = [e for e, there in zip(manifest.files, present, strict=True) if not there]
    progress.on_start(manifest.total_bytes, manifest.total_bytes - sum(e.size_bytes for e in todo))

    config = TransferConfig(
        multipart_threshold=settings.part_size_bytes,
        multipart_chunksize=settings.part_size_bytes,
        max_concurrency=settings.concurrency,
        use_threads=True,
    )
    with create_transfer_manager(client, config) as manager:
        futures = [
            (
                entry,
                manager.upload(
                    str(src / entry.path),
                    uri.bucket,
                    uri.key(entry.path),
                    extra_args={"Metadata": {SHA256_METADATA: entry.sha256}},
                    subscribers=[_Subscriber(progress)],
                ),
            )
            for entry in todo
        ]
        for entry, future in futures:
            try:
                future.result()
            except (ClientError, BotoCoreError, OSError) as e:
                raise TransferError(entry.path, f"upload failed: {e}") from e
            progress.on_file_done(entry.path, entry.size_bytes)

    body = manifest.to_bytes()
    manifest_key = uri.key(MANIFEST_NAME)
    written = get_bytes(client, uri.bucket, manifest_key, MAX_MANIFEST_BYTES) != body
    if written:
        client.put_object(
            Bucket=uri.bucket,
            Key=manifest_key,
            Body=body,
            ContentType="application/json",
            Metadata={SHA256_METADATA: manifest.digest},
        )
    return PopulateResult(
        uri=uri,
        digest=manifest.digest,
        manifest=manifest,
        uploaded_files=len(todo),
        skipped_files=len(manifest.files) - len(todo),
        uploaded_bytes=sum(e.size_bytes for e in todo),
        manifest_written=written,
        elapsed_s=clock() - started,
    )
