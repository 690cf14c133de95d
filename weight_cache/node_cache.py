"""The node cache: models keyed by manifest digest, one puller per model across processes (a file
lock), leases for models in use, and LRU eviction under a size bound.

Layout under the root::

    models/<digest>/       complete, verified models (renamed in from staging/)
    staging/<digest>/      a pull in progress (resumable after a crash)
    meta/<digest>.json     size, model id, state and last use; meta/<digest>.manifest the manifest
    meta/<digest>.verified each file's (inode, size, mtime_ns, ctime_ns) when its sha256 last matched
    locks/<digest>.lock    flock: held while pulling, leasing or evicting that model
    locks/evict.lock       flock: one eviction decision at a time
    leases/<digest>/       one file per process using the model
    streams/<digest>/      hardlinks to the files verified so far, for an engine that loads while
                           the pull runs (kvfleet.weight_stream); removed with the model
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvfleet.weight_cache.errors import LockTimeoutError, NodeCacheError, NodeCacheFullError, PullStoppedError
from kvfleet.weight_cache.eviction import CacheEntry, plan_eviction
from kvfleet.weight_cache.leases import ModelLease, create_lease, live_leases
from kvfleet.weight_cache.manifest import Manifest, ManifestFile, sha256_file
from kvfleet.weight_cache.settings import NodeCacheSettings

log = logging.getLogger(__name__)

DIGEST_CHARS = 64


# What a hit records and compares in "stat" mode. ctime cannot be set from userland: any write,
# chmod, rename or utimensat moves it to now, so an equal tuple means the file was not touched
# since it was verified (same inode: not replaced; same ctime: not written).
StatKey = tuple[int, int, int, int]
MAX_REASONS = 8


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class HitCheck:
    """Whether ``models/<digest>`` may be used as it is, and why not. ``good`` lists the files that
    passed (a re-pull keeps them); ``reasons`` name the files refused (at most MAX_REASONS)."""

    hit: bool
    reasons: tuple[str, ...]
    good: frozenset[str]
    hashed_bytes: int
    seconds: float
    mode: str
    refused_count: int = 0


def _check_digest(digest: str) -> str:
    if len(digest) != DIGEST_CHARS or any(c not in "0123456789abcdef" for c in digest):
        raise NodeCacheError(f"{digest!r} is not a sha256 hex digest")
    return digest


class NodeCache:
    def __init__(
        self,
        root: Path,
        settings: NodeCacheSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.root = root
        self.settings = settings or NodeCacheSettings()
        self.clock = clock
        self.sleep = sleep
        for sub in ("models", "staging", "meta", "locks", "leases", "streams", "trash"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def model_path(self, digest: str) -> Path:
        return self.root / "models" / _check_digest(digest)

    def staging_path(self, digest: str) -> Path:
        return self.root / "staging" / _check_digest(digest)

    def stream_path(self, digest: str) -> Path:
        return self.root / "streams" / _check_digest(digest)

    def _meta_path(self, digest: str) -> Path:
        return self.root / "meta" / f"{_check_digest(digest)}.json"

    def _leases_dir(self, digest: str) -> Path:
        return self.root / "leases" / _check_digest(digest)

    # -- locks -------------------------------------------------------------------------------

    @contextmanager
    def _flock(self, name: str, *, blocking: bool, stop: threading.Event | None = None) -> Iterator[bool]:
        """Hold ``locks/<name>``; yields False at once when not ``blocking`` and it is taken.
        flock is released by the kernel when the process dies, so a crash never leaves it held.
        ``stop``: set by the caller to give up waiting within one poll (``PullStoppedError``)."""
        fd = os.open(self.root / "locks" / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + self.settings.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if not blocking:
                    yield False
                    return
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"{name}: held by another process for more than {self.settings.lock_timeout_s:g} s"
                    )
                if stop is not None and stop.is_set():
                    raise PullStoppedError(f"{name}: stopped while another process held it; nothing was written")
                self.sleep(self.settings.lock_poll_s)
            yield True
        finally:
            os.close(fd)  # closing drops the flock

    @contextmanager
    def model_lock(self, digest: str, stop: threading.Event | None = None) -> Iterator[None]:
        """Hold the model's lock, waiting up to ``lock_timeout_s`` for another process's pull;
        ``stop`` ends the wait within ``lock_poll_s``."""
        with self._flock(f"{_check_digest(digest)}.lock", blocking=True, stop=stop):
            yield

    # -- state -------------------------------------------------------------------------------

    def _read_meta(self, digest: str) -> dict[str, object] | None:
        try:
            data = json.loads(self._meta_path(digest).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def record(self, digest: str, manifest: Manifest, *, state: str, raw_manifest: bytes | None = None) -> None:
        """Write the model's metadata (atomically); ``lastUsedS`` is now, which is what LRU reads."""
        meta = {
            "digest": digest,
            "modelId": manifest.model_id,
            "sizeBytes": manifest.total_bytes,
            "state": state,
            "lastUsedS": self.clock(),
        }
        path = self._meta_path(digest)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, path)
        if raw_manifest is not None:
            (self.root / "meta" / f"{digest}.manifest").write_bytes(raw_manifest)

    def stored_manifest(self, digest: str) -> bytes | None:
        try:
            return (self.root / "meta" / f"{_check_digest(digest)}.manifest").read_bytes()
        except OSError:
            return None

    def _verified_path(self, digest: str) -> Path:
        return self.root / "meta" / f"{_check_digest(digest)}.verified"

    def _read_verified(self, digest: str) -> dict[str, StatKey]:
        try:
            data = json.loads(self._verified_path(digest).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            k: (v[0], v[1], v[2], v[3])
            for k, v in data.items()
            if isinstance(v, list) and len(v) == 4 and all(isinstance(x, int) for x in v)
        }

    def record_verified(self, digest: str, manifest: Manifest) -> None:
        """Remember each file's stat key now that its content is known good (after a verified
        download or a hit that hashed it). Call with the model lock held."""
        path = self.model_path(digest)
        keys = {entry.path: list(stat_key((path / entry.path).stat())) for entry in manifest.files}
        target = self._verified_path(digest)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(keys))
        os.replace(tmp, target)

    def check_hit(
        self, digest: str, manifest: Manifest, *, verify: Literal["sha256", "stat"], hash_workers: int = 4
    ) -> HitCheck:
        """Whether ``models/<digest>`` holds every file of ``manifest`` with the manifest's content.

        ``sha256`` hashes every file (``hash_workers`` at once); ``stat`` hashes only the files
        whose stat key differs from the one recorded when they were last verified. A symlink, a
        file of the wrong size or one whose sha256 differs is refused, with the reason."""
        started = time.monotonic()
        path = self.model_path(digest)
        if not path.is_dir():
            return HitCheck(False, (), frozenset(), 0, time.monotonic() - started, verify)
        recorded = self._read_verified(digest) if verify == "stat" else {}
        inside = path.resolve()
        reasons: list[str] = []
        good: set[str] = set()
        to_hash: list[ManifestFile] = []
        for entry in manifest.files:
            file = path / entry.path
            try:
                st = file.lstat()
            except OSError:
                reasons.append(f"{entry.path}: missing")
                continue
            if not stat.S_ISREG(st.st_mode) or not file.resolve().is_relative_to(inside):
                reasons.append(f"{entry.path}: not a regular file inside the model's directory")
            elif st.st_size != entry.size_bytes:
                reasons.append(f"{entry.path}: {st.st_size} bytes, the manifest says {entry.size_bytes}")
            elif recorded.get(entry.path) == stat_key(st):
                good.add(entry.path)
            else:
                to_hash.append(entry)

        def matches(entry: ManifestFile) -> bool:
            try:
                return sha256_file(path / entry.path) == entry.sha256
            except OSError:
                return False

        with ThreadPoolExecutor(max_workers=max(1, min(hash_workers, len(to_hash) or 1))) as pool:
            results = list(pool.map(matches, to_hash))
        for entry, ok in zip(to_hash, results, strict=True):
            if ok:
                good.add(entry.path)
            else:
                reasons.append(f"{entry.path}: sha256 differs from the manifest's (a damaged or planted file)")
        hit = not reasons
        seconds = time.monotonic() - started
        if reasons:
            log.warning(
                "node cache: model %s refused on a hit (%s); fetching the refused files again",
                digest[:12],
                "; ".join(reasons[:MAX_REASONS]),
            )
        elif to_hash:
            self.record_verified(digest, manifest)
        return HitCheck(
            hit,
            tuple(reasons[:MAX_REASONS]),
            frozenset(good),
            sum(e.size_bytes for e in to_hash),
            seconds,
            verify,
            refused_count=len(reasons),
        )

    def acquire_lease(self, digest: str) -> ModelLease:
        """Call with the model lock held, so no eviction can run between the check and the lease."""
        return create_lease(self._leases_dir(digest), digest)

    def entries(self, *, skip: str | None = None) -> list[CacheEntry]:
        found: list[CacheEntry] = []
        for meta_path in sorted((self.root / "meta").glob("*.json")):
            digest = meta_path.stem
            if digest == skip or len(digest) != DIGEST_CHARS:
                continue
            meta = self._read_meta(digest)
            if meta is None:
                continue
            with self._flock(f"{digest}.lock", blocking=False) as got:
                busy = not got
            size = meta.get("sizeBytes", 0)
            last = meta.get("lastUsedS", 0.0)
            found.append(
                CacheEntry(
                    digest=digest,
                    size_bytes=int(size) if isinstance(size, int) else 0,
                    last_used_s=float(last) if isinstance(last, int | float) else 0.0,
                    in_use=bool(live_leases(self._leases_dir(digest), remove_dead=True)),
                    busy=busy,
                )
            )
        return found

    def make_room(self, need_bytes: int, *, keep: str) -> tuple[str, ...]:
        """Evict least recently used idle models until ``need_bytes`` fit; returns the evicted digests."""
        limit = self.settings.size_limit_bytes
        if limit is None:
            return ()
        with self._flock("evict.lock", blocking=True):
            plan = plan_eviction(self.entries(skip=keep), need_bytes, limit)
            if not plan.fits:
                raise NodeCacheFullError(f"node cache {self.root}: {plan.reason}")
            evicted = tuple(d for d in plan.evict if self.evict(d))
            if len(evicted) < len(plan.evict):
                # A model became busy or leased between the plan and the eviction: decide again.
                again = plan_eviction(self.entries(skip=keep), need_bytes, limit)
                if again.evict or not again.fits:
                    raise NodeCacheFullError(f"node cache {self.root}: {again.reason}")
            if evicted:
                log.info("node cache: %s; evicted %s", plan.reason, ", ".join(d[:12] for d in evicted))
            return evicted

    def evict(self, digest: str) -> bool:
        """Remove a model unless it is locked or leased; False when it was kept."""
        with self._flock(f"{_check_digest(digest)}.lock", blocking=False) as got:
            if not got or live_leases(self._leases_dir(digest), remove_dead=True):
                return False
            # Rename first: a reader never sees a half-deleted model under models/.
            token = uuid.uuid4().hex[:8]
            for kind, source in (
                ("model", self.model_path(digest)),
                ("staging", self.staging_path(digest)),
                ("stream", self.stream_path(digest)),
            ):
                if source.exists():
                    os.replace(source, self.root / "trash" / f"{digest}-{kind}-{token}")
            self._meta_path(digest).unlink(missing_ok=True)
            (self.root / "meta" / f"{digest}.manifest").unlink(missing_ok=True)
            self._verified_path(digest).unlink(missing_ok=True)
            shutil.rmtree(self._leases_dir(digest), ignore_errors=True)
        for leftover in (self.root / "trash").glob(f"{digest}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return True

    def stage_for_repair(self, digest: str, good: frozenset[str]) -> Path:
        """Start ``staging/<digest>`` afresh with the files in ``good`` (just verified) moved over
        from the refused model, and throw the rest away: a pull then fetches the refused files only,
        and nothing that was refused (a planted symlink, a stray directory) comes along. Returns the
        staging directory. Caller holds the model lock."""
        self._verified_path(digest).unlink(missing_ok=True)
        path, staging = self.model_path(digest), self.staging_path(digest)
        token = uuid.uuid4().hex[:8]
        if staging.exists():
            os.replace(staging, self.root / "trash" / f"{digest}-staging-{token}")
        staging.mkdir()
        for rel in sorted(good):
            target = staging.joinpath(*rel.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path.joinpath(*rel.split("/")), target)
        if path.exists():
            os.replace(path, self.root / "trash" / f"{digest}-model-{token}")
        for leftover in (self.root / "trash").glob(f"{digest}-*-{token}"):
            shutil.rmtree(leftover, ignore_errors=True)
        return staging

    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries())
