"""One pass of a pull over a set of files: HEAD each object (its size and ETag), stream its parts
with parallel ranged GETs into the partial files, retry only the retryable failures, hash each file
in order as its parts land, and hand finished files to ``PartialFile.finish`` to verify and place.

The transfer alone: which files to fetch and how often to try again after a checksum mismatch is
``download.pull_to_dir``'s decision; what makes a file trustworthy is ``partial_file``'s."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import urllib3.exceptions
from botocore.exceptions import BotoCoreError, ClientError

from kvfleet.weight_cache.errors import ObjectChangedError, PullStoppedError, TransferError
from kvfleet.weight_cache.manifest import ManifestFile
from kvfleet.weight_cache.partial_file import PartialFile
from kvfleet.weight_cache.parts import Part, backoff_s
from kvfleet.weight_cache.progress import TransferProgress
from kvfleet.weight_cache.s3 import S3Client, S3Uri, error_code, is_not_found
from kvfleet.weight_cache.settings import PullSettings

# The pull logs under one name (the module that starts it), whichever of its modules writes.
log = logging.getLogger("kvfleet.weight_cache.download")

# botocore's standard retry mode already retried these on the request; a second layer here also
# covers failures while streaming the body, which botocore does not retry.
RETRYABLE_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"})
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412"})
_STREAM_ERRORS = (BotoCoreError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


class _Cancelled(Exception):
    """Another worker failed; this one stops between chunks."""


class _ShortRead(Exception):
    pass


class PullRound:
    """One pass over a set of files; raises the first transfer error, returns checksum failures."""

    def __init__(
        self,
        client: S3Client,
        uri: S3Uri,
        work: Path,
        settings: PullSettings,
        progress: TransferProgress,
        sleep: Callable[[float], None],
        stop: threading.Event | None = None,
    ) -> None:
        self.client = client
        self.uri = uri
        self.work = work
        self.settings = settings
        self.progress = progress
        self.sleep = sleep
        self.cancel = threading.Event()
        # Set by the caller (the engine the pull feeds is gone): every worker ends at its next
        # chunk, so a stop waits at most one chunk read per worker.
        self.stop = stop or threading.Event()
        self.errors: list[BaseException] = []
        self.downloaded_bytes = 0
        self.resumed_bytes = 0
        self._count_lock = threading.Lock()

    def run(self, entries: list[tuple[ManifestFile, Path]]) -> list[PartialFile]:
        states: list[PartialFile] = []
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

    def _open(self, entry: ManifestFile, final: Path, etag: str) -> PartialFile:
        return PartialFile.open(
            self.work,
            entry,
            final,
            key=self.uri.key(entry.path),
            etag=etag,
            part_size_bytes=self.settings.part_size_bytes,
        )

    def _check_stop(self, path: str) -> None:
        if self.stop.is_set():
            raise PullStoppedError(f"{path}: the pull was stopped; its journal keeps what is written")

    def _guarded(self, state: PartialFile, part: Part) -> None:
        if self.cancel.is_set():
            return
        try:
            self._check_stop(state.entry.path)
            self._run_part(state, part)
        except BaseException as e:
            self.errors.append(e)
            self.cancel.set()
            raise

    def _run_part(self, state: PartialFile, part: Part) -> None:
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

    def _download_part(self, state: PartialFile, part: Part, inline: bool) -> None:
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
            self._check_stop(state.entry.path)
            if attempt < attempts:
                log.warning(
                    "retrying %s %s (attempt %d/%d): %s", state.entry.path, part.http_range, attempt, attempts, last
                )
                self.sleep(backoff_s(attempt, self.settings))
        raise TransferError(
            state.entry.path, f"GET {part.http_range} failed after {attempts} attempts: {last}"
        ) from last

    def _stream_part(self, state: PartialFile, part: Part, inline: bool) -> None:
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
                self._check_stop(state.entry.path)
                chunk = body.read(min(chunk_bytes, end - offset))
                if not chunk:
                    raise _ShortRead(f"short read: {offset - part.start} of {part.length} bytes")
                state.write(chunk, offset, start_writeback=self.settings.fsync and self.settings.start_writeback)
                if inline:
                    state.hasher.update(chunk)
                offset += len(chunk)
                with self._count_lock:
                    self.downloaded_bytes += len(chunk)
                self.progress.on_bytes(len(chunk))
        finally:
            body.close()

    def _advance(self, state: PartialFile) -> None:
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
                state.hash_from_disk(state.parts[index], self.settings.stream_chunk_bytes)
            with state.lock:
                state.next_index += 1
                complete = state.next_index == len(state.parts)
            if complete:
                self._finish(state)

    def _finish(self, state: PartialFile) -> None:
        if state.finish(fsync=self.settings.fsync):
            self.progress.on_file_done(state.entry.path, state.entry.size_bytes)
