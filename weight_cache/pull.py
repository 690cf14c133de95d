"""``pull_model``: the engine launcher's entry point. Pull a model into the node cache (or find it
there), and hold a lease on it for as long as the caller uses it."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvfleet.weight_cache.download import FetchedManifest, PullResult, fetch_manifest, pull_to_dir
from kvfleet.weight_cache.errors import DigestMismatchError, DiskFullError, ManifestError, SourceUnavailableError
from kvfleet.weight_cache.leases import ModelLease
from kvfleet.weight_cache.manifest import Manifest, digest_of
from kvfleet.weight_cache.node_cache import HitCheck, NodeCache
from kvfleet.weight_cache.progress import TransferProgress
from kvfleet.weight_cache.s3 import S3Client, S3Uri, make_client
from kvfleet.weight_cache.settings import NodeCacheSettings, PullSettings, S3Settings
from kvfleet.weight_stream import StreamWriter, expose

log = logging.getLogger(__name__)


@dataclass
class PulledModel:
    """A model in the node cache, leased by this process until ``release()`` (or the process ends)."""

    path: Path
    digest: str
    manifest: Manifest
    hit: bool
    lease: ModelLease
    result: PullResult | None  # the download's figures; None on a hit
    # What the node cache's content check found: files hashed, time taken, files refused and why.
    check: HitCheck

    def release(self) -> None:
        self.lease.release()

    def __enter__(self) -> PulledModel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _manifest_for(client: S3Client, uri: S3Uri, cache: NodeCache, expected_digest: str | None) -> FetchedManifest:
    try:
        fetched = fetch_manifest(client, uri)
    except SourceUnavailableError:
        # S3 is down, but a pinned model already on this node can still start.
        raw = cache.stored_manifest(expected_digest) if expected_digest else None
        if raw is None:
            raise
        if digest_of(raw) != expected_digest:
            # The node cache's copy is not the pinned manifest (damaged, or written by someone else).
            raise ManifestError(
                f"{uri}: S3 is unreachable and the node cache's manifest of {expected_digest} hashes to "
                f"{digest_of(raw)}; refusing it"
            ) from None
        log.warning("S3 unreachable; using the node cache's copy of model %s", expected_digest)
        return FetchedManifest(manifest=Manifest.from_bytes(raw), raw=raw, digest=expected_digest)
    if expected_digest is not None and fetched.digest != expected_digest:
        raise DigestMismatchError(
            f"{uri}: manifest digest is {fetched.digest}, expected {expected_digest} "
            "(the model at this prefix changed)",
            found=fetched.digest,
            expected=expected_digest,
        )
    return fetched


def _publish_from(stream: StreamWriter, root: Path, relative: str) -> None:
    stream.publish(relative, root.joinpath(*relative.split("/")))


def pull_model(
    source_uri: str,
    node_cache_root: Path,
    settings: PullSettings | None = None,
    *,
    node_cache_settings: NodeCacheSettings | None = None,
    s3: S3Settings | None = None,
    client: S3Client | None = None,
    progress: TransferProgress | None = None,
    expected_digest: str | None = None,
    clock: Callable[[], float] = time.time,
    stream_link: Path | None = None,
    stop: threading.Event | None = None,
) -> PulledModel:
    """Make the model at ``source_uri`` (s3://bucket/prefix) available under ``node_cache_root``.

    Concurrent callers on one node pulling the same model coordinate through a file lock: one
    downloads, the others wait (up to ``lock_timeout_s``) and then reuse it. Before a download,
    least recently used models without live leases are evicted to respect ``size_limit_bytes``.

    ``stream_link``: a path an engine loads from while this runs (kvfleet.weight_stream). Once this
    process holds the model's lock, it becomes a symlink to the model's stream folder in the node
    cache, which then holds only files verified now and the manifest's file list; each file this
    pull verifies is hardlinked in the moment its sha256 matched (every file at once on a hit).

    ``stop``: set it to end a download within one chunk read per worker (``PullStoppedError``):
    nothing enters ``models/``, the stream folder keeps only verified files, and the partial files
    and their journal stay in ``staging/`` for the next pull of the model to resume from. A pull
    still waiting for another process's lock on the model gives up within ``lock_poll_s``.
    """
    settings = settings or PullSettings()
    uri = S3Uri.parse(source_uri)
    if client is None:
        client = make_client(s3 or S3Settings(), max_pool_connections=settings.concurrency)
    cache = NodeCache(node_cache_root, node_cache_settings, clock=clock)
    fetched = _manifest_for(client, uri, cache, expected_digest)
    manifest, digest = fetched.manifest, fetched.digest
    manifest.check_allowed(allow_pickle=settings.allow_pickle)

    with cache.model_lock(digest, stop=stop):
        result: PullResult | None = None
        check = cache.check_hit(digest, manifest, verify=settings.verify_on_hit, hash_workers=settings.hash_workers)
        stream: StreamWriter | None = None
        if stream_link is not None:
            stream = StreamWriter(cache.stream_path(digest))
            model_dir = cache.model_path(digest)
            stream.reset(
                [entry.path for entry in manifest.files],
                {rel: model_dir.joinpath(*rel.split("/")) for rel in check.good},
            )
            expose(stream_link, stream.directory)
        if not check.hit:
            # Refused files are fetched again, never loaded; the files that just hashed right stay.
            staging = cache.stage_for_repair(digest, check.good) if check.reasons else cache.staging_path(digest)
            cache.record(digest, manifest, state="pulling")
            cache.make_room(manifest.total_bytes, keep=digest)
            publish = None
            if stream is not None:
                publish = functools.partial(_publish_from, stream, staging)
            try:
                result = pull_to_dir(
                    client,
                    uri,
                    staging,
                    settings,
                    progress=progress,
                    fetched=fetched,
                    known_good=check.good,
                    on_verified=publish,
                    stop=stop,
                )
            except DiskFullError:
                shutil.rmtree(staging, ignore_errors=True)  # nothing of a pull that cannot fit stays
                raise
            os.replace(staging, cache.model_path(digest))  # atomic: readers see all of it or nothing
            cache.record_verified(digest, manifest)  # every file was hashed as it landed
        elif stream is not None:
            for entry in manifest.files:
                _publish_from(stream, cache.model_path(digest), entry.path)
        lease = cache.acquire_lease(digest)
        cache.record(digest, manifest, state="ready", raw_manifest=fetched.raw)
    return PulledModel(
        path=cache.model_path(digest),
        digest=digest,
        manifest=manifest,
        hit=check.hit,
        lease=lease,
        result=result,
        check=check,
    )
