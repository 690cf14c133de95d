"""The node cache: models keyed by manifest digest, one puller per model across processes (a file
lock), leases for models in use, and LRU eviction under a size bound.

Layout under the root::

    models/<digest>/       complete, verified models (renamed in from staging/)
    staging/<digest>/      a pull in progress (resumable after a crash)
    meta/<digest>.json     size, model id, state and last use; meta/<digest>.manifest the manifest
    locks/<digest>.lock    flock: held while pulling, leasing or evicting that model
    locks/evict.lock       flock: one eviction decision at a time
    leases/<digest>/       one file per process using the model
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvfleet.weight_cache.errors import LockTimeoutError, NodeCacheError, NodeCacheFullError
from kvfleet.weight_cache.eviction import CacheEntry, plan_eviction
from kvfleet.weight_cache.leases import Lease, create_lease, live_leases
from kvfleet.weight_cache.manifest import Manifest, sha256_file
from kvfleet.weight_cache.settings import NodeCacheSettings

log = logging.getLogger(__name__)

DIGEST_CHARS = 64


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
        for sub in ("models", "staging", "meta", "locks", "leases", "trash"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def model_path(self, digest: str) -> Path:
        return self.root / "models" / _check_digest(digest)

    def staging_path(self, digest: str) -> Path:
        return self.root / "staging" / _check_digest(digest)

    def _meta_path(self, digest: str) -> Path:
        return self.root / "meta" / f"{_check_digest(digest)}.json"

    def _leases_dir(self, digest: str) -> Path:
        return self.root / "leases" / _check_digest(digest)

    # -- locks -------------------------------------------------------------------------------

    @contextmanager
    def _flock(self, name: str, *, blocking: bool) -> Iterator[bool]:
        """Hold ``locks/<name>``; yields False at once when not ``blocking`` and it is taken.
        flock is released by the kernel when the process dies, so a crash never leaves it held."""
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
                self.sleep(self.settings.lock_poll_s)
            yield True
        finally:
            os.close(fd)  # closing drops the flock

    @contextmanager
    def model_lock(self, digest: str) -> Iterator[None]:
        with self._flock(f"{_check_digest(digest)}.lock", blocking=True):
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

    def is_complete(self, digest: str, manifest: Manifest, *, verify: str) -> bool:
        """Whether ``models/<digest>`` holds every file: by size, or by sha256 when asked."""
        path = self.model_path(digest)
        if not path.is_dir():
            return False
        for entry in manifest.files:
            file = path / entry.path
            try:
                if file.is_symlink() or file.stat().st_size != entry.size_bytes:
                    return False
            except OSError:
                return False
            if verify == "sha256" and sha256_file(file) != entry.sha256:
                log.warning("node cache: %s in %s fails its sha256; pulling the model again", entry.path, digest)
                return False
        return True

    def acquire_lease(self, digest: str) -> Lease:
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
            for kind, source in (("model", self.model_path(digest)), ("staging", self.staging_path(digest))):
                if source.exists():
                    os.replace(source, self.root / "trash" / f"{digest}-{kind}-{token}")
            self._meta_path(digest).unlink(missing_ok=True)
            (self.root / "meta" / f"{digest}.manifest").unlink(missing_ok=True)
            shutil.rmtree(self._leases_dir(digest), ignore_errors=True)
        for leftover in (self.root / "trash").glob(f"{digest}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return True

    def discard_invalid(self, digest: str) -> None:
        """Move a model that failed verification out of models/ (caller holds its lock)."""
        path = self.model_path(digest)
        if path.exists():
            trash = self.root / "trash" / f"{digest}-{uuid.uuid4().hex[:8]}"
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries())
