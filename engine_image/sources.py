"""What the launcher needs from the weight cache, as small interfaces it can be handed.

The launcher depends on these protocols, not on boto3: the real implementations wrap
``kvfleet.weight_cache`` (see ``cache_adapter``), and local paths (file://, pvc://) need no
cache at all. Implementations translate their own errors into :class:`LaunchError` with the phase.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvfleet.weight_cache.artifacts import ArtifactOffer, ArtifactPullResult
from kvfleet.weight_cache.fingerprint import Fingerprint
from kvfleet.weight_cache.progress import TransferProgress

from .errors import LaunchError
from .launch_spec import LaunchSpec

# A local model directory is hashed by file names, sizes and modification times (stat only):
# reading every byte of a multi-GB claim on each start would cost more than the cache saves.
MAX_LOCAL_FILES = 10_000


@dataclass(frozen=True)
class PulledWeights:
    """Weights ready on local disk for the engine."""

    path: Path
    digest: str
    # "node-cache" (already on the node), "s3" (pulled now) or "local" (file:// or pvc://).
    source: str
    bytes_fetched: int = 0
    # Releases the node-cache lease that keeps these weights from being evicted while served.
    release: Callable[[], None] | None = None
    # The node cache's content check: what it found (phase detail), files it refused and why.
    check: Mapping[str, Any] = field(default_factory=dict)
    refused_files: int = 0

    @property
    def node_cache_hit(self) -> bool:
        return self.source in ("node-cache", "local")


class WeightPuller(Protocol):
    """Brings a deployment's weights onto this node (blocking; the launcher runs it in a thread),
    telling ``progress`` about the bytes as they move (nothing when there is nothing to move)."""

    def pull(self, launch: LaunchSpec, progress: TransferProgress) -> PulledWeights: ...


class StreamingWeightPuller(WeightPuller, Protocol):
    """A puller that also fills ``stream_link`` with each file as it is verified, so an engine can
    load while the pull runs (kvfleet.weight_stream). Setting ``stop`` ends the pull early (the
    engine it feeds is gone) with a ``LaunchError`` in the pull phase; what is written stays
    resumable."""

    def pull_streaming(
        self, launch: LaunchSpec, progress: TransferProgress, stream_link: Path, stop: threading.Event | None = None
    ) -> PulledWeights: ...


class ArtifactStore(Protocol):
    """Fingerprinted engine artifacts (compile caches) in the weight cache bucket, with a signed
    copy on the node. Only artifacts signed by a trusted key, for this fingerprint, whose bytes
    match are restored; the others are refused with a ``refusal`` and a reason."""

    @property
    def can_push(self) -> bool:
        """Whether this launcher holds a signing key (never in engine pods the operator renders)."""
        ...

    def restore_local(self, fp: Fingerprint, dest: Path) -> ArtifactPullResult:
        """Unpack the node's signed copy for ``fp`` into ``dest`` (empty) after checking it again."""
        ...

    def describe(self, fp: Fingerprint) -> ArtifactOffer:
        """What the bucket holds for ``fp`` (size, build time), checked before fetching anything."""
        ...

    def fetch(self, fp: Fingerprint, dest: Path, offer: ArtifactOffer) -> ArtifactPullResult:
        """Download, verify and unpack the artifacts for ``fp`` into ``dest`` (empty), keeping a node copy."""
        ...

    def push(self, fp: Fingerprint, src: Path, build_seconds: float | None) -> None:
        """Upload and sign ``src`` as the artifacts for ``fp``, recording the start-up work it replaces."""
        ...


def local_model_path(uri: str, pvc_mount_root: Path) -> Path | None:
    """The directory of a file:// or pvc:// model, or None for remote models (s3://, hf://)."""
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if uri.startswith("pvc://"):
        claim_and_path = uri[len("pvc://") :]
        return pvc_mount_root / claim_and_path
    return None


def stat_digest(directory: Path) -> str:
    """A digest of a local model directory from its files' names, sizes and mtimes."""
    h = hashlib.sha256()
    count = 0
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            st = path.stat()
            h.update(f"{path.relative_to(directory)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            count += 1
            if count > MAX_LOCAL_FILES:
                raise LaunchError("pull", f"{directory} holds more than {MAX_LOCAL_FILES} files; is it a model?")
    return h.hexdigest()


class LocalWeights:
    """file:// and pvc:// models: already on a mounted filesystem, nothing to pull."""

    def __init__(self, pvc_mount_root: Path) -> None:
        self._pvc_mount_root = pvc_mount_root

    def pull(self, launch: LaunchSpec, progress: TransferProgress) -> PulledWeights:
        path = local_model_path(launch.spec.model.uri, self._pvc_mount_root)
        if path is None:
            raise LaunchError("pull", f"{launch.spec.model.uri} is not a local model (file:// or pvc://)")
        if not (path / "config.json").is_file():
            raise LaunchError("pull", f"no model at {path} (config.json is missing)")
        return PulledWeights(path=path, digest=stat_digest(path), source="local")
