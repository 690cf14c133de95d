"""The reference engine's compile cache: where torch.compile keeps its work, and when it is trusted.

With ``--artifacts-dir DIR`` the engine points Inductor's on-disk caches (FX graph cache, compiled
C++ kernels on CPU, Triton kernels on CUDA) at ``DIR/inductor`` before compiling, and writes
``DIR/compile.json`` once every graph is compiled: the identity the cache was built for and how
long the compile took. The next start with the same identity compiles from that cache (a hit:
no C++ or Triton compiler runs); a directory whose ``compile.json`` names anything else (another
torch, device capability, model architecture, dtype, buckets or mode), or that has no
``compile.json`` (a start that died mid-compile), is emptied first and never loaded.

The launcher restores ``DIR`` as part of the fingerprinted artifact; this check keeps a
hand-passed ``--artifacts-dir`` just as safe, and gives the reason in the engine's log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

COMPILE_MANIFEST = "compile.json"
START_REPORT = "compile-start.json"
INDUCTOR_SUBDIR = "inductor"
TRITON_SUBDIR = "triton"
FORMAT = 1


def device_capability(device: torch.device) -> str:
    """What compiled kernels are specialised to: the CPU's vector ISA, or the GPU's compute capability."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return str(torch.backends.cpu.get_cpu_capability())


def compile_identity(
    model_dir: Path, dtype: torch.dtype, device: torch.device, *, mode: str, sizes_tokens: tuple[int, ...]
) -> dict[str, Any]:
    """Everything the compiled graphs depend on. The weights' values are not among them (they are
    graph inputs), only the architecture in config.json."""
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "device": device.type,
        "capability": device_capability(device),
        "configSha256": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "dtype": str(dtype),
        "mode": mode,
        "sizesTokens": list(sizes_tokens) if mode == "static" else [],
    }


@dataclass(frozen=True)
class CacheCheck:
    """What was found in the artifacts directory before compiling, and why it is (not) used."""

    hit: bool
    reason: str


def _mismatch(stored: dict[str, Any], identity: dict[str, Any]) -> str:
    fields = [k for k in identity if stored.get(k) != identity[k]]
    return ", ".join(f"{k} {stored.get(k)!r} != {identity[k]!r}" for k in fields)


def _read_manifest(directory: Path) -> dict[str, Any] | str | None:
    path = directory / COMPILE_MANIFEST
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{COMPILE_MANIFEST} is unreadable ({e})"
    if not isinstance(value, dict) or not isinstance(value.get("identity"), dict):
        return f"{COMPILE_MANIFEST} has no identity"
    return value


def cache_files(directory: Path) -> dict[str, str]:
    """sha256 of every file of the compile cache, by path relative to ``directory``. Compiled
    kernels are shared libraries the process loads: a damaged one would crash it, not raise, so
    every file is checked before the cache is used."""
    out: dict[str, str] = {}
    for sub in (INDUCTOR_SUBDIR, TRITON_SUBDIR):
        root = directory / sub
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                out[path.relative_to(directory).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _damaged(directory: Path, files: dict[str, str]) -> str | None:
    for rel, want in files.items():
        path = directory / rel
        try:
            got = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return f"{rel} is missing"
        if got != want:
            return f"{rel} is damaged (sha256 {got[:12]}..., expected {want[:12]}...)"
    return None


def check_cache(directory: Path, identity: dict[str, Any]) -> CacheCheck:
    """Verdict on ``directory`` (reads, never writes): hit, or why not."""
    manifest = _read_manifest(directory)
    if isinstance(manifest, str):
        return CacheCheck(False, manifest)
    if manifest is None:
        if (directory / INDUCTOR_SUBDIR).exists():
            return CacheCheck(False, f"{INDUCTOR_SUBDIR}/ but no {COMPILE_MANIFEST}: an earlier compile never finished")
        return CacheCheck(False, "no compile cache yet")
    stored = manifest["identity"]
    if stored != identity:
        return CacheCheck(False, f"compile cache built for another identity ({_mismatch(stored, identity)})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return CacheCheck(False, f"{COMPILE_MANIFEST} lists no cache files")
    damage = _damaged(directory, files)
    if damage is not None:
        return CacheCheck(False, f"compile cache not loaded: {damage}")
    return CacheCheck(True, "compile cache matches this torch, device, model, dtype and shapes")


def discard(directory: Path) -> None:
    """Remove the compile cache (manifest first, so a crash halfway leaves no trusted remains)."""
    (directory / COMPILE_MANIFEST).unlink(missing_ok=True)
    (directory / START_REPORT).unlink(missing_ok=True)
    shutil.rmtree(directory / INDUCTOR_SUBDIR, ignore_errors=True)
    shutil.rmtree(directory / TRITON_SUBDIR, ignore_errors=True)


def open_cache(directory: Path, identity: dict[str, Any]) -> CacheCheck:
    """Check the cache, empty it unless it is a hit, and point Inductor and Triton at it.

    Must run before the first compile: Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` when it looks
    a graph up."""
    verdict = check_cache(directory, identity)
    if not verdict.hit:
        discard(directory)
    else:
        _drop_unlisted(directory, set(_read_manifest_files(directory)))
    (directory / INDUCTOR_SUBDIR).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / INDUCTOR_SUBDIR)
    os.environ["TRITON_CACHE_DIR"] = str(directory / TRITON_SUBDIR)
    log.info("compile cache %s: %s (%s)", directory, "hit" if verdict.hit else "miss", verdict.reason)
    return verdict


def _read_manifest_files(directory: Path) -> dict[str, str]:
    manifest = _read_manifest(directory)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return files if isinstance(files, dict) else {}


def _drop_unlisted(directory: Path, listed: set[str]) -> None:
    # Files the manifest does not vouch for (left by a later run, or added to a restored copy)
    # are not loaded either.
    for rel in cache_files(directory):
        if rel not in listed:
            (directory / rel).unlink(missing_ok=True)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    # Temp file then rename: a half-written file is never read.
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(json.dumps(doc, sort_keys=True))
    os.replace(tmp, path)


def write_manifest(directory: Path, identity: dict[str, Any], *, compile_s: float) -> None:
    """After a compile that missed: what the cache is for and the compile time it replaces."""
    doc = {"identity": identity, "compileSeconds": round(compile_s, 4), "files": cache_files(directory)}
    _write_json(directory / COMPILE_MANIFEST, doc)


def write_start_report(directory: Path, verdict: CacheCheck, *, compile_s: float) -> None:
    """This start's compile (hit or miss, seconds, why): read by the launcher for its phase log.
    A separate file, so a restored cache's own files are never rewritten."""
    _write_json(
        directory / START_REPORT,
        {"cacheHit": verdict.hit, "reason": verdict.reason, "compileSeconds": round(compile_s, 4)},
    )


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
