"""Pull a model from S3 into a directory: which files to fetch (those not already in place and
verified), rounds of parallel ranged GETs over them (``pull_round``), and a bounded number of
downloads again for a file whose sha256 does not match the manifest.

Each file is written into a partial file, hashed in file order as its parts arrive, and renamed into
place (temp file + fsync + atomic rename) only after its sha256 matched the manifest
(``partial_file``). A pull resumes: a later pull of the same file continues from the parts its
journal lists; a changed object (new ETag) or part size starts over.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from kvfleet.weight_cache.errors import ChecksumMismatchError, DiskFullError, ManifestError, SourceUnavailableError
from kvfleet.weight_cache.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestFile, digest_of
from kvfleet.weight_cache.manifest import sha256_file as _sha256_file
from kvfleet.weight_cache.partial_file import WORK_DIR
from kvfleet.weight_cache.parts import fetch_rank
from kvfleet.weight_cache.progress import NullProgress, TransferProgress, throughput_line
from kvfleet.weight_cache.pull_round import PullRound
from kvfleet.weight_cache.s3 import S3Client, S3Uri, error_code, get_bytes
from kvfleet.weight_cache.safety import resolve_inside
from kvfleet.weight_cache.settings import PullSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedManifest:
    manifest: Manifest
    raw: bytes
    digest: str


def fetch_manifest(client: S3Client, uri: S3Uri) -> FetchedManifest:
    """The manifest at ``uri`` and its digest (sha256 of the bytes exactly as stored)."""
    key = uri.key(MANIFEST_NAME)
    try:
        raw = get_bytes(client, uri.bucket, key, MAX_MANIFEST_BYTES)
    except ClientError as e:
        raise ManifestError(f"{uri}: cannot read {MANIFEST_NAME}: {error_code(e) or e}") from e
    except BotoCoreError as e:
        raise SourceUnavailableError(f"{uri}: S3 server unreachable: {e}") from e
    if raw is None:
        raise ManifestError(f"{uri}: no {MANIFEST_NAME} there; run `kvfleet cache populate` for this prefix first")
    return FetchedManifest(manifest=Manifest.from_bytes(raw), raw=raw, digest=digest_of(raw))


@dataclass(frozen=True)
class PullResult:
    dest: Path
    digest: str
    manifest: Manifest
    downloaded_bytes: int
    reused_bytes: int
    elapsed_s: float
    files_downloaded: int
    files_reused: int

    def throughput_line(self) -> str:
        extra = f"{self.files_downloaded} files downloaded, {self.files_reused} reused"
        if self.reused_bytes:
            extra += f" ({self.reused_bytes} bytes already in place)"
        return throughput_line("pulled", self.downloaded_bytes, self.elapsed_s, extra)


def _already_in_place(entry: ManifestFile, final: Path) -> bool:
    """A file an earlier pull finished (renamed into place after verification) is kept if it still
    hashes right; a local rehash is much cheaper than downloading it again."""
    try:
        if not final.is_file() or final.stat().st_size != entry.size_bytes:
            return False
    except OSError:
        return False
    return _sha256_file(final) == entry.sha256


class _NotifyingProgress:
    """Forwards to ``inner``; a file done (verified and renamed into place) is also announced."""

    def __init__(self, inner: TransferProgress, on_verified: Callable[[str], None]) -> None:
        self._inner = inner
        self._on_verified = on_verified

    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        self._inner.on_start(total_bytes, done_bytes)

    def on_bytes(self, count: int) -> None:
        self._inner.on_bytes(count)

    def on_resumed(self, count: int) -> None:
        self._inner.on_resumed(count)

    def on_file_done(self, path: str, size_bytes: int) -> None:
        self._inner.on_file_done(path, size_bytes)
        self._on_verified(path)


def space_shortfall_bytes(need_bytes: int, free_bytes: int) -> int:
    """How many bytes the disk lacks for ``need_bytes`` more (0: it fits). Pure, so the rule reads
    in one place: a pull that cannot fit fails before it writes anything."""
    return max(0, need_bytes - free_bytes)


def _bytes_on_disk(work: Path) -> int:
    """Blocks already allocated to partial files (a resume writes into them, not beside them)."""
    if not work.is_dir():
        return 0
    return sum(p.stat().st_blocks * 512 for p in work.glob("*.part"))


def _disk_full(dest: Path, need_bytes: int, free_bytes: int, cause: str) -> DiskFullError:
    return DiskFullError(
        f"{dest}: no space left for the model: {need_bytes} more bytes needed, {free_bytes} free "
        f"({cause}); free space on the node cache's disk or lower its size limit. Partial files removed."
    )


def pull_to_dir(
    client: S3Client,
    uri: S3Uri,
    dest: Path,
    settings: PullSettings | None = None,
    *,
    progress: TransferProgress | None = None,
    fetched: FetchedManifest | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    known_good: frozenset[str] = frozenset(),
    on_verified: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> PullResult:
    """Download the model at ``uri`` into ``dest`` and verify every file against the manifest.

    ``known_good``: paths in ``dest`` the caller hashed against this manifest a moment ago (the node
    cache's content check, under the model's lock); they are kept without a second hash.
    ``on_verified(path)``: called once per file as soon as it is in place in ``dest`` and its sha256
    matched (files already there first, then each download the moment it is renamed into place),
    so a reader can load it before the pull ends.

    Raises ``DisallowedFileError`` / ``UnsafePathError`` before downloading anything when the
    manifest lists a refused file type or a path that would leave ``dest``; ``ChecksumMismatchError``
    naming the file when it still hashes wrong after ``file_attempts`` downloads; ``TransferError``
    naming the file when a ranged GET keeps failing. Partial data is kept for the next attempt.
    ``stop``: set by the caller to end the pull within one chunk read per worker
    (``PullStoppedError``); the partial files and their journal stay for a later resume.
    """
    settings = settings or PullSettings()
    progress = progress or NullProgress()
    fetched = fetched or fetch_manifest(client, uri)
    manifest = fetched.manifest
    manifest.check_allowed(allow_pickle=settings.allow_pickle)
    dest.mkdir(parents=True, exist_ok=True)
    targets = [(entry, resolve_inside(dest, entry.path)) for entry in manifest.files]
    started = clock()

    def in_place_now(pair: tuple[ManifestFile, Path]) -> bool:
        entry, final = pair
        if entry.path in known_good:
            return final.is_file() and final.stat().st_size == entry.size_bytes
        return _already_in_place(entry, final)

    with ThreadPoolExecutor(max_workers=2) as hashers:
        in_place = list(hashers.map(in_place_now, targets))
    todo = sorted(
        (pair for pair, done in zip(targets, in_place, strict=True) if not done),
        key=lambda pair: fetch_rank(pair[0].path),
    )
    reused_bytes = sum(entry.size_bytes for (entry, _), done in zip(targets, in_place, strict=True) if done)
    progress.on_start(manifest.total_bytes, reused_bytes)
    if on_verified is not None:
        for (entry, _), done in zip(targets, in_place, strict=True):
            if done:
                on_verified(entry.path)
        progress = _NotifyingProgress(progress, on_verified)

    work = dest / WORK_DIR
    need = sum(entry.size_bytes for entry, _ in todo) - _bytes_on_disk(work)
    free = shutil.disk_usage(dest).free
    if space_shortfall_bytes(need, free):
        shutil.rmtree(work, ignore_errors=True)
        raise _disk_full(dest, need, free, "checked before the download")
    work.mkdir(exist_ok=True)
    downloaded = 0
    files_downloaded = len(todo)
    for attempt in range(1, settings.file_attempts + 1):
        round_ = PullRound(client, uri, work, settings, progress, sleep, stop)
        try:
            failed = round_.run(todo)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            # Something else filled the disk during the pull: a partial file is of no use to a
            # resume that cannot fit either, and it holds the space others need.
            shutil.rmtree(work, ignore_errors=True)
            raise _disk_full(dest, need, shutil.disk_usage(dest).free, f"{os.strerror(e.errno)} while writing") from e
        finally:
            downloaded += round_.downloaded_bytes
            reused_bytes += round_.resumed_bytes
        if not failed:
            break
        if attempt == settings.file_attempts:
            first = failed[0]
            raise ChecksumMismatchError(
                first.entry.path,
                f"sha256 is {first.mismatch}, the manifest says {first.entry.sha256} "
                f"(downloaded {settings.file_attempts} times); the object on the server does not match "
                f"the manifest: populate the model again"
                + (f" ({len(failed) - 1} more files failed too)" if len(failed) > 1 else ""),
            )
        mismatched = {s.entry.path for s in failed}
        todo = [pair for pair in todo if pair[0].path in mismatched]
        log.warning("sha256 mismatch on %s; downloading again", ", ".join(sorted(mismatched)))
    shutil.rmtree(work, ignore_errors=True)
    return PullResult(
        dest=dest,
        digest=fetched.digest,
        manifest=manifest,
        downloaded_bytes=downloaded,
        reused_bytes=reused_bytes,
        elapsed_s=clock() - started,
        files_downloaded=files_downloaded,
        files_reused=len(targets) - files_downloaded,
    )


__all__ = [
    "FetchedManifest",
    "PullResult",
    "fetch_manifest",
    "pull_to_dir",
]
