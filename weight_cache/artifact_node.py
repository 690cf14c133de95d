"""Node copies of signed engine artifacts, checked again on every use.

The node cache may be a hostPath shared by every pod on the node, so anything in it may have been
written by a co-tenant: a node copy is never trusted because it is there (no marker file). A node
copy is the verified tarball plus the sidecar it was verified with. Each launch re-checks the
sidecar's signature against the trusted keys and the fingerprint it asks for, copies the tarball
into its own directory (one no other pod can write), and unpacks that copy only when its bytes
hash to the signed digest. A copy that fails is deleted, so the next launch fetches a good one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvfleet.weight_cache.artifacts import (
    DEFAULT_MAX_ARTIFACT_BYTES,
    MAX_SIDECAR_BYTES,
    ArtifactOffer,
    ArtifactPullResult,
    check_dest,
    check_sidecar,
    restore_verified,
)
from kvfleet.weight_cache.fingerprint import Fingerprint
from kvfleet.weight_cache.signing import ArtifactTrust

log = logging.getLogger(__name__)

NODE_DIR = "signed"


def node_paths(root: Path, fp: Fingerprint) -> tuple[Path, Path]:
    """The node copy's tarball and sidecar under the node's artifacts root."""
    base = root / NODE_DIR
    return base / f"{fp.key}.tar", base / f"{fp.key}.sidecar.json"


def discard_node_copy(root: Path, fp: Fingerprint) -> None:
    for path in node_paths(root, fp):
        with contextlib.suppress(OSError):
            path.unlink()


def keep_node_copy(root: Path, fp: Fingerprint, tar_path: Path, offer: ArtifactOffer) -> None:
    """Keep a verified tarball and its sidecar on the node (temp file, then atomic rename). A node
    that cannot keep it only loses the next launch's head start, so failures are logged, not raised."""
    tar_dest, sidecar_dest = node_paths(root, fp)
    try:
        tar_dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".tmp-", dir=tar_dest.parent) as tmp:
            shutil.copyfile(tar_path, Path(tmp) / "artifact.tar")
            (Path(tmp) / "sidecar.json").write_bytes(offer.sidecar)
            # The tarball first: a sidecar never names bytes that are not in place yet.
            os.replace(Path(tmp) / "artifact.tar", tar_dest)
            os.replace(Path(tmp) / "sidecar.json", sidecar_dest)
    except OSError as e:
        log.warning("artifact %s: node copy not kept: %s", fp.key, e)


def restore_node_copy(
    root: Path, fp: Fingerprint, trust: ArtifactTrust, dest: Path, *, max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES
) -> ArtifactPullResult:
    """Unpack the node copy for ``fp`` into ``dest`` (absent or empty; in a directory only this pod
    writes) if it is signed by a trusted key for ``fp`` and its bytes match. Never raises on a bad copy."""
    check_dest(dest)
    tar_path, sidecar_path = node_paths(root, fp)
    try:
        with sidecar_path.open("rb") as f:
            raw = f.read(MAX_SIDECAR_BYTES + 1)
    except FileNotFoundError:
        return ArtifactPullResult(hit=False, reason="no copy on this node", key=fp.key)
    except OSError as e:
        return ArtifactPullResult(hit=False, reason=f"cannot read {sidecar_path}: {e}", key=fp.key, warning=True)
    offer = check_sidecar(raw, fp, trust, where=f"node copy {sidecar_path}", max_bytes=max_bytes)
    if not offer.found:
        log.warning("artifact %s ignored: %s", fp.key, offer.reason)
        discard_node_copy(root, fp)
        return ArtifactPullResult(
            hit=False, reason=offer.reason, key=fp.key, size_bytes=offer.size_bytes, warning=True, refusal=offer.refusal
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kvfleet-artifact-", dir=dest.parent) as tmp:
        private = Path(tmp) / "artifact.tar"
        try:
            shutil.copyfile(tar_path, private)
        except OSError as e:
            discard_node_copy(root, fp)
            return ArtifactPullResult(hit=False, reason=f"cannot copy {tar_path}: {e}", key=fp.key, warning=True)
        result = restore_verified(private, offer, fp, dest, max_bytes=max_bytes)
    if not result.hit:
        discard_node_copy(root, fp)
    return result
