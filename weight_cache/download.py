"""Pull a model from S3 into a directory: parallel ranged GETs across and within files, sha256
computed in file order as parts arrive, temp file + fsync + atomic rename, resumable.

Layout while pulling: ``DEST/.kvfleet-partial/<sha256>.part`` holds a file's bytes at their final
offsets and ``<sha256>.journal`` lists the parts already written (header: size, part size, ETag).
A later pull of the same file resumes from the journal; a changed object (new ETag) or part size
starts over. A finished file is renamed into place only after its sha256 matched the manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import urllib3.exceptions
from botocore.exceptions import BotoCoreError, ClientError

from kvfleet.weight_cache.errors import (
    ChecksumMismatchError,
    ManifestError,
    ObjectChangedError,
    SourceUnavailableError,
    TransferError,
    WeightCacheError,
)
from kvfleet.weight_cache.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestFile, digest_of
from kvfleet.weight_cache.manifest import sha256_file as _sha256_file
from kvfleet.weight_cache.progress import NullProgress, TransferProgress, throughput_line
from kvfleet.weight_cache.s3 import S3Client, S3Uri, error_code, get_bytes, is_not_found
from kvfleet.weight_cache.safety import RESERVED_PREFIX, resolve_inside
from kvfleet.weight_cache.settings import PullSettings

log = logging.getLogger(__name__)

WORK_DIR = f"{RESERVED_PREFIX}-partial"
# botocore's standard retry mode already retried these on the request; a second layer here also
# covers failures while streaming the body, which botocore does not retry.
RETRYABLE_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"})
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412"})
_STREAM_ERRORS = (BotoCoreError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


@dataclass(frozen=True)
class Part:
    index: int
    start: int
    length: int

    @property
    def http_range(self) -> str:
        return f"bytes={self.start}-{self.start + self.length - 1}"


def plan_parts(size_bytes: int, part_size_bytes: int) -> tuple[Part, ...]:
    """Split a file into ranged GETs: full parts, then the remainder."""
    if part_size_bytes <= 0:
        raise ValueError("part_size_bytes must be positive")
    return tuple(
        Part(index=i, start=start, length=min(part_size_bytes, size_bytes - start))
        for i, start in enumerate(range(0, size_bytes, part_size_bytes))
    )


def backoff_s(attempt: int, settings: PullSettings) -> float:
    """Delay before retry number ``attempt`` (1-based): exponential, capped."""
    return float(min(settings.retry_backoff_max_s, settings.retry_backoff_s * 2 ** (attempt - 1)))


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


class _Journal:
    """Which parts of a ``.part`` file are written. Appends are flushed but not fsynced: a part lost
    in a crash makes the final sha256 fail, and the file is downloaded again."""

    def __init__(self, path: Path, header: dict[str, object]) -> None:
        self.path = path
        self.done: set[int] = set()
        if path.exists():
            lines = path.read_text().splitlines()
            try:
                if lines and json.loads(lines[0]) == header:
                    self.done = {int(line) for line in lines[1:] if line.strip()}
            except ValueError:  # a torn line from a crash: start this file over
                self.done = set()
        if not self.done:
            path.write_text(json.dumps(header) + "\n")
        self._file = path.open("a")
        self._lock = threading.Lock()

    def record(self, index: int) -> None:
        with self._lock:
            self._file.write(f"{index}\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class _FileState:
    """One file being pulled. Workers deposit parts; whoever finds the next part in order hashes
    it, so hashing overlaps the download and never needs the whole file in memory."""

    entry: ManifestFile
    key: str
    etag: str
    final: Path
    partial: Path
    parts: tuple[Part, ...]
    journal: _Journal
    fd: int
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    next_index: int = 0
    pending: dict[int, bytes] = field(default_factory=dict)
    draining: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    mismatch: str | None = None
    finished: bool = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.journal.close()


class _Round:
    """One pass over a set of files; raises the first transfer error, returns checksum failures."""

    def __init__(
        self,
        client: S3Client,
        uri: S3Uri,
        work: Path,
        settings: PullSettings,
        progress: TransferProgress,
        sleep: Callable[[float], None],
    ) -> None:
        self.client = client
        self.uri = uri
        self.work = work
        self.settings = settings
        self.progress = progress
        self.sleep = sleep
        self.cancel = threading.Event()
        self.slots = threading.Semaphore(settings.buffered_parts)
        self.errors: list[BaseException] = []
        self.downloaded_bytes = 0
        self.resumed_bytes = 0
        self._count_lock = threading.Lock()

    def run(self, entries: list[tuple[ManifestFile, Path]]) -> list[_FileState]:
        states: list[_FileState] = []
        pool = ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix="kvfleet-pull")
        futures: list[Future[None]] = []
        try:
            heads = list(pool.map(self._head, [entry for entry, _ in entries]))
            for (entry, final), etag in zip(entries, heads, strict=True):
                states.append(self._open(entry, final, etag))
            for state in states:
                if not state.parts:
                    self._finish(state)
                    continue
                for part in state.parts:
                    if not self._acquire_slot():
                        break
                    futures.append(pool.submit(self._guarded, state, part))
                if self.cancel.is_set():
                    break
            for future in futures:
                future.result()
        except BaseException as e:
            # Ctrl-C or an error while scheduling: stop the workers, keep what is written.
            self.cancel.set()
            self.errors.append(e)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for state in states:
                state.close()
        if self.errors:
            raise self.errors[0]
        return [s for s in states if s.mismatch is not None]

    def _acquire_slot(self) -> bool:
        # A part holds a slot until it is hashed; the earliest unhashed part is always already
        # submitted (parts go out in order), so waiting here cannot deadlock, only cancel.
        while not self.slots.acquire(timeout=0.1):
            if self.cancel.is_set():
                return False
        return not self.cancel.is_set()

    def _head(self, entry: ManifestFile) -> str:
        key = self.uri.key(entry.path)
        try:
            head = self.client.head_object(Bucket=self.uri.bucket, Key=key)
        except ClientError as e:
            if is_not_found(e):
                raise TransferError(entry.path, f"missing on the server (s3://{self.uri.bucket}/{key})") from e
            raise TransferError(entry.path, f"HEAD s3://{self.uri.bucket}/{key} failed: {error_code(e)}") from e
        except _STREAM_ERRORS as e:
            raise TransferError(entry.path, f"HEAD s3://{self.uri.bucket}/{key} failed: {e}") from e
        if head["ContentLength"] != entry.size_bytes:
            raise ObjectChangedError(
                entry.path,
                f"the server has {head['ContentLength']} bytes, the manifest says {entry.size_bytes}: "
                "the object was replaced after populate (populate again)",
            )
        return str(head["ETag"])

    def _open(self, entry: ManifestFile, final: Path, etag: str) -> _FileState:
        partial = self.work / f"{entry.sha256}.part"
        header: dict[str, object] = {
            "sizeBytes": entry.size_bytes,
            "partSizeBytes": self.settings.part_size_bytes,
            "etag": etag,
        }
        journal = _Journal(self.work / f"{entry.sha256}.journal", header)
        if not journal.done and partial.exists():
            partial.unlink()
        fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
        state = _FileState(
            entry=entry,
            key=self.uri.key(entry.path),
            etag=etag,
            final=final,
            partial=partial,
            parts=plan_parts(entry.size_bytes, self.settings.part_size_bytes),
            journal=journal,
            fd=fd,
        )
        return state

    def _guarded(self, state: _FileState, part: Part) -> None:
        if self.cancel.is_set():
            return
        try:
            self._run_part(state, part)
        except BaseException as e:
            self.errors.append(e)
            self.cancel.set()
            raise

    def _run_part(self, state: _FileState, part: Part) -> None:
        data: bytes | None = None
        if part.index in state.journal.done:
            data = os.pread(state.fd, part.length, part.start)
            if len(data) == part.length:
                with self._count_lock:
                    self.resumed_bytes += part.length
            else:  # the journal ran ahead of the data (a crash): fetch it again
                data = None
        if data is None:
            data = self._get_range(state, part)
            view = memoryview(data)
            written = 0
            while written < len(data):
                written += os.pwrite(state.fd, view[written:], part.start + written)
            state.journal.record(part.index)
            with self._count_lock:
                self.downloaded_bytes += len(data)
            self.progress.on_bytes(len(data))
        self._deposit(state, part.index, data)

    def _get_range(self, state: _FileState, part: Part) -> bytes:
        last: BaseException | None = None
        attempts = self.settings.part_attempts
        for attempt in range(1, attempts + 1):
            if self.cancel.is_set():
                raise TransferError(state.entry.path, "cancelled")
            try:
                response = self.client.get_object(
                    Bucket=self.uri.bucket, Key=state.key, Range=part.http_range, IfMatch=state.etag
                )
                data = response["Body"].read()
                if len(data) == part.length:
                    return data
                last = TransferError(state.entry.path, f"short read: {len(data)} of {part.length} bytes")
            except ClientError as e:
                code = error_code(e)
                if code in PRECONDITION_CODES:
                    raise ObjectChangedError(
                        state.entry.path, "the object changed on the server during the pull (ETag differs)"
                    ) from e
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
                if code not in RETRYABLE_CODES and status < 500:
                    raise TransferError(state.entry.path, f"GET {part.http_range} failed: {code or e}") from e
                last = e
            except _STREAM_ERRORS as e:
                last = e
            if attempt < attempts:
                log.warning(
                    "retrying %s %s (attempt %d/%d): %s", state.entry.path, part.http_range, attempt, attempts, last
                )
                self.sleep(backoff_s(attempt, self.settings))
        raise TransferError(
            state.entry.path, f"GET {part.http_range} failed after {attempts} attempts: {last}"
        ) from last

    def _deposit(self, state: _FileState, index: int, data: bytes) -> None:
        with state.lock:
            state.pending[index] = data
            if state.draining:
                return
            state.draining = True
        while True:
            with state.lock:
                chunk = state.pending.pop(state.next_index, None)
                if chunk is None:
                    state.draining = False
                    return
                state.next_index += 1
            state.hasher.update(chunk)  # outside the lock: hashlib releases the GIL
            self.slots.release()
            if state.next_index == len(state.parts):
                self._finish(state)

    def _finish(self, state: _FileState) -> None:
        got = state.hasher.hexdigest()
        if got != state.entry.sha256:
            log.warning("%s: sha256 %s does not match the manifest's %s", state.entry.path, got, state.entry.sha256)
            state.mismatch = got
            state.close()
            state.partial.unlink(missing_ok=True)
            state.journal.path.unlink(missing_ok=True)
            return
        if self.settings.fsync:
            os.fsync(state.fd)
        state.close()
        state.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(state.partial, state.final)
        if self.settings.fsync:
            _fsync_dir(state.final.parent)
        state.journal.path.unlink(missing_ok=True)
        state.finished = True
        self.progress.on_file_done(state.entry.path, state.entry.size_bytes)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _already_in_place(entry: ManifestFile, final: Path) -> bool:
    """A file an earlier pull finished (renamed into place after verification) is kept if it still
    hashes right; a local rehash is much cheaper than downloading it again."""
    try:
        if not final.is_file() or final.stat().st_size != entry.size_bytes:
            return False
    except OSError:
        return False
    return _sha256_file(final) == entry.sha256


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
) -> PullResult:
    """Download the model at ``uri`` into ``dest`` and verify every file against the manifest.

    Raises ``DisallowedFileError`` / ``UnsafePathError`` before downloading anything when the
    manifest lists a refused file type or a path that would leave ``dest``; ``ChecksumMismatchError``
    naming the file when it still hashes wrong after ``file_attempts`` downloads; ``TransferError``
    naming the file when a ranged GET keeps failing. Partial data is kept for the next attempt.
    """
    settings = settings or PullSettings()
    progress = progress or NullProgress()
    fetched = fetched or fetch_manifest(client, uri)
    manifest = fetched.manifest
    manifest.check_allowed(allow_pickle=settings.allow_pickle)
    dest.mkdir(parents=True, exist_ok=True)
    targets = [(entry, resolve_inside(dest, entry.path)) for entry in manifest.files]
    started = clock()

    with ThreadPoolExecutor(max_workers=2) as hashers:
        in_place = list(hashers.map(lambda pair: _already_in_place(*pair), targets))
    todo = [pair for pair, done in zip(targets, in_place, strict=True) if not done]
    reused_bytes = sum(entry.size_bytes for (entry, _), done in zip(targets, in_place, strict=True) if done)
    progress.on_start(manifest.total_bytes, reused_bytes)

    work = dest / WORK_DIR
    work.mkdir(exist_ok=True)
    downloaded = 0
    files_downloaded = len(todo)
    for attempt in range(1, settings.file_attempts + 1):
        round_ = _Round(client, uri, work, settings, progress, sleep)
        try:
            failed = round_.run(todo)
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
    "Part",
    "PullResult",
    "WeightCacheError",
    "backoff_s",
    "fetch_manifest",
    "plan_parts",
    "pull_to_dir",
]
