"""Pull a model from S3 into a directory: parallel ranged GETs across and within files, sha256
computed in file order as parts arrive, temp file + fsync + atomic rename, resumable.

Layout while pulling: ``DEST/.kvfleet-partial/<sha256>-<path hash>.part`` holds a file's bytes at
their final offsets and ``<sha256>-<path hash>.journal`` lists the parts already written (header:
size, part size, ETag); the path hash keeps byte-identical files of one model apart.
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
    """One file being pulled. Parts are written at their offsets as they stream in. The sha256 runs
    in file order: a part that starts when every earlier part is hashed is hashed as it streams;
    a part that finishes early is hashed later from the file (page cache) by whichever worker
    completes the gap. Memory stays at one chunk per worker, whatever the part size."""

    entry: ManifestFile
    key: str
    etag: str
    final: Path
    partial: Path
    parts: tuple[Part, ...]
    journal: _Journal
    fd: int
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    next_index: int = 0  # the first part not yet hashed
    written: set[int] = field(default_factory=set)  # parts complete on disk
    hashed_inline: set[int] = field(default_factory=set)
    draining: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    mismatch: str | None = None
    finished: bool = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.journal.close()


class _Cancelled(Exception):
    """Another worker failed; this one stops between chunks."""


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
            # Parts go out file by file, in order: the earliest parts finish first, so the
            # in-order hash rarely has to read a part back from disk.
            for state in states:
                if not state.parts:
                    self._finish(state)
                for part in state.parts:
                    futures.append(pool.submit(self._guarded, state, part))
            for future in futures:
                future.result()
        except BaseException as e:
            # Ctrl-C or a failed part: stop the workers, keep what is written for a resume.
            self.cancel.set()
            self.errors.append(e)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for state in states:
                state.close()
        if self.errors:
            first = self.errors[0]
            raise next((e for e in self.errors if not isinstance(e, _Cancelled)), first)
        return [s for s in states if s.mismatch is not None]

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
        # One partial file per destination path: byte-identical files (same sha256) are downloaded
        # side by side, and a shared partial would be renamed away under the second one.
        stem = f"{entry.sha256}-{hashlib.sha256(entry.path.encode()).hexdigest()[:16]}"
        partial = self.work / f"{stem}.part"
        header: dict[str, object] = {
            "sizeBytes": entry.size_bytes,
            "partSizeBytes": self.settings.part_size_bytes,
            "etag": etag,
        }
        journal = _Journal(self.work / f"{stem}.journal", header)
        if not journal.done and partial.exists():
            partial.unlink()
        fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
        return _FileState(
            entry=entry,
            key=self.uri.key(entry.path),
            etag=etag,
            final=final,
            partial=partial,
            parts=plan_parts(entry.size_bytes, self.settings.part_size_bytes),
            journal=journal,
            fd=fd,
        )

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
        if part.index in state.journal.done:
            with self._count_lock:
                self.resumed_bytes += part.length
            self.progress.on_resumed(part.length)
        else:
            with state.lock:
                # Every earlier part is hashed and no one else touches the hasher until this part
                # is marked written, so this worker may feed it as the bytes arrive.
                inline = state.next_index == part.index
            self._download_part(state, part, inline)
            state.journal.record(part.index)
            with state.lock:
                if inline:
                    state.hashed_inline.add(part.index)
        with state.lock:
            state.written.add(part.index)
        self._advance(state)

    def _download_part(self, state: _FileState, part: Part, inline: bool) -> None:
        last: BaseException | None = None
        attempts = self.settings.part_attempts
        before = state.hasher.copy() if inline else None
        for attempt in range(1, attempts + 1):
            if before is not None:
                state.hasher = before.copy()  # a retry restarts the part, and its hash
            try:
                self._stream_part(state, part, inline)
                return
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
            except (*_STREAM_ERRORS, _ShortRead) as e:
                last = e
            if attempt < attempts:
                log.warning(
                    "retrying %s %s (attempt %d/%d): %s", state.entry.path, part.http_range, attempt, attempts, last
                )
                self.sleep(backoff_s(attempt, self.settings))
        raise TransferError(
            state.entry.path, f"GET {part.http_range} failed after {attempts} attempts: {last}"
        ) from last

    def _stream_part(self, state: _FileState, part: Part, inline: bool) -> None:
        response = self.client.get_object(
            Bucket=self.uri.bucket, Key=state.key, Range=part.http_range, IfMatch=state.etag
        )
        body = response["Body"]
        offset = part.start
        end = part.start + part.length
        chunk_bytes = self.settings.stream_chunk_bytes
        try:
            while offset < end:
                if self.cancel.is_set():
                    raise _Cancelled(state.entry.path)
                chunk = body.read(min(chunk_bytes, end - offset))
                if not chunk:
                    raise _ShortRead(f"short read: {offset - part.start} of {part.length} bytes")
                _pwrite_all(state.fd, chunk, offset)
                if self.settings.fsync and _SYNC_FILE_RANGE is not None:
                    # Start writeback now so the fsync at the end finds little left to do.
                    _SYNC_FILE_RANGE(state.fd, offset, len(chunk), _SYNC_FILE_RANGE_WRITE)
                if inline:
                    state.hasher.update(chunk)
                offset += len(chunk)
                with self._count_lock:
                    self.downloaded_bytes += len(chunk)
                self.progress.on_bytes(len(chunk))
        finally:
            body.close()

    def _advance(self, state: _FileState) -> None:
        """Hash written parts in order, reading back the ones not hashed while streaming."""
        with state.lock:
            if state.draining:
                return
            state.draining = True
        while True:
            with state.lock:
                index = state.next_index
                if index >= len(state.parts) or index not in state.written:
                    state.draining = False
                    return
                inline = index in state.hashed_inline
            if not inline:
                self._hash_from_disk(state, state.parts[index])
            with state.lock:
                state.next_index += 1
                complete = state.next_index == len(state.parts)
            if complete:
                self._finish(state)

    def _hash_from_disk(self, state: _FileState, part: Part) -> None:
        offset, end = part.start, part.start + part.length
        while offset < end:
            chunk = os.pread(state.fd, min(self.settings.stream_chunk_bytes, end - offset), offset)
            if not chunk:
                break  # a resumed part the crash lost: the sha256 will not match, and the file is fetched again
            state.hasher.update(chunk)
            offset += len(chunk)

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


class _ShortRead(Exception):
    pass


# Linux only; elsewhere the fsync does all the flushing.
_SYNC_FILE_RANGE = getattr(os, "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE = getattr(os, "SYNC_FILE_RANGE_WRITE", 2)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    written = 0
    while written < len(data):
        written += os.pwrite(fd, view[written:], offset + written)


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
    known_good: frozenset[str] = frozenset(),
) -> PullResult:
    """Download the model at ``uri`` into ``dest`` and verify every file against the manifest.

    ``known_good``: paths in ``dest`` the caller hashed against this manifest a moment ago (the node
    cache's content check, under the model's lock); they are kept without a second hash.

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

    def in_place_now(pair: tuple[ManifestFile, Path]) -> bool:
        entry, final = pair
        if entry.path in known_good:
            return final.is_file() and final.stat().st_size == entry.size_bytes
        return _already_in_place(entry, final)

    with ThreadPoolExecutor(max_workers=2) as hashers:
        in_place = list(hashers.map(in_place_now, targets))
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
