"""A file being pulled, on disk: the ``.part`` file its parts are written into at their offsets,
the journal of parts already written (what a later pull resumes from), the sha256 that runs in
file order, and the check that renames the file into place only when that sha256 matches.

Layout under ``DEST/.kvfleet-partial/``: ``<sha256>-<path hash>.part`` and ``.journal`` (header:
size, part size, ETag); the path hash keeps byte-identical files of one model apart. Apart from the
transfer (``pull_round``) so what makes a file trustworthy (verify, fsync, atomic rename, cleanup
of a mismatch) reads in one place."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.weight_cache.manifest import ManifestFile
from kvfleet.weight_cache.parts import Part, plan_parts
from kvfleet.weight_cache.safety import RESERVED_PREFIX

# The pull logs under one name (the module that starts it), whichever of its modules writes.
log = logging.getLogger("kvfleet.weight_cache.download")

WORK_DIR = f"{RESERVED_PREFIX}-partial"

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


def _libc_sync_file_range() -> Callable[[int, int, int, int], None] | None:
    """Linux's sync_file_range(2) from the C library: CPython's ``os`` has no binding for it (3.11 to
    3.13), so ctypes calls libc's, which releases the GIL like any foreign call. None elsewhere:
    there the fsync before the rename does all the flushing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if fn(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return sync_file_range


_SYNC_FILE_RANGE = _libc_sync_file_range()


class Journal:
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
class PartialFile:
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
    journal: Journal
    fd: int
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    next_index: int = 0  # the first part not yet hashed
    written: set[int] = field(default_factory=set)  # parts complete on disk
    hashed_inline: set[int] = field(default_factory=set)
    draining: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    mismatch: str | None = None
    finished: bool = False

    @classmethod
    def open(
        cls, work: Path, entry: ManifestFile, final: Path, *, key: str, etag: str, part_size_bytes: int
    ) -> PartialFile:
        """The partial file for ``entry`` under ``work``, resuming the parts its journal lists when
        the object (ETag) and the part size are the same as when they were written."""
        # One partial file per destination path: byte-identical files (same sha256) are downloaded
        # side by side, and a shared partial would be renamed away under the second one.
        stem = f"{entry.sha256}-{hashlib.sha256(entry.path.encode()).hexdigest()[:16]}"
        partial = work / f"{stem}.part"
        header: dict[str, object] = {
            "sizeBytes": entry.size_bytes,
            "partSizeBytes": part_size_bytes,
            "etag": etag,
        }
        journal = Journal(work / f"{stem}.journal", header)
        if not journal.done and partial.exists():
            partial.unlink()
        fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
        return cls(
            entry=entry,
            key=key,
            etag=etag,
            final=final,
            partial=partial,
            parts=plan_parts(entry.size_bytes, part_size_bytes),
            journal=journal,
            fd=fd,
        )

    def write(self, chunk: bytes, offset: int, *, start_writeback: bool) -> None:
        """Write ``chunk`` at ``offset``; ``start_writeback`` starts flushing it now so the fsync at
        the end finds little left to do."""
        _pwrite_all(self.fd, chunk, offset)
        if start_writeback and _SYNC_FILE_RANGE is not None:
            _SYNC_FILE_RANGE(self.fd, offset, len(chunk), _SYNC_FILE_RANGE_WRITE)

    def hash_from_disk(self, part: Part, chunk_bytes: int) -> None:
        """Feed a part written out of order to the hasher, read back from the file."""
        offset, end = part.start, part.start + part.length
        while offset < end:
            chunk = os.pread(self.fd, min(chunk_bytes, end - offset), offset)
            if not chunk:
                break  # a resumed part the crash lost: the sha256 will not match, and the file is fetched again
            self.hasher.update(chunk)
            offset += len(chunk)

    def finish(self, *, fsync: bool) -> bool:
        """Every part is hashed: rename the file into place if its sha256 matches the manifest
        (True), or drop it and its journal and record the mismatch (False)."""
        got = self.hasher.hexdigest()
        if got != self.entry.sha256:
            log.warning("%s: sha256 %s does not match the manifest's %s", self.entry.path, got, self.entry.sha256)
            self.mismatch = got
            self.close()
            self.partial.unlink(missing_ok=True)
            self.journal.path.unlink(missing_ok=True)
            return False
        if fsync:
            os.fsync(self.fd)
        self.close()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.partial, self.final)
        if fsync:
            _fsync_dir(self.final.parent)
        self.journal.path.unlink(missing_ok=True)
        self.finished = True
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.journal.close()


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
