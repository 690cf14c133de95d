"""The model manifest: model id, revision and each file's size and sha256. The sha256 of the
manifest's stored bytes is the model digest, the model's identity everywhere in kvfleet."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvfleet.weight_cache.errors import ManifestError, SourceUnavailableError, UnsafePathError
from kvfleet.weight_cache.safety import check_file_allowed, check_relative_path

MANIFEST_NAME = "manifest.json"
SCHEMA = "kvfleet.io/model-manifest/v1"
MAX_FILES = 100_000
MAX_MANIFEST_BYTES = 32 << 20
HASH_CHUNK_BYTES = 8 << 20

Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ManifestFile(_Wire):
    path: str
    size_bytes: int = Field(ge=0, le=1 << 44)
    sha256: Sha256Hex

    @field_validator("path")
    @classmethod
    def _safe(cls, value: str) -> str:
        try:
            return check_relative_path(value)
        except UnsafePathError as e:
            raise ValueError(str(e)) from e


class Manifest(_Wire):
    schema_: str = Field(default=SCHEMA, alias="schema")
    model_id: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    revision: Annotated[str, StringConstraints(max_length=256)] | None = None
    files: tuple[ManifestFile, ...] = Field(max_length=MAX_FILES)

    @field_validator("schema_")
    @classmethod
    def _known_schema(cls, value: str) -> str:
        if value != SCHEMA:
            raise ValueError(f"unknown manifest schema {value!r} (this kvfleet reads {SCHEMA!r})")
        return value

    @model_validator(mode="after")
    def _unique_paths(self) -> Manifest:
        seen: set[str] = set()
        for entry in self.files:
            # A file and a directory of the same name cannot both exist on disk.
            if entry.path in seen or any(p in seen for p in _parents(entry.path)):
                raise ValueError(f"{entry.path}: listed twice or also used as a directory")
            seen.add(entry.path)
        if any(p in seen for entry in self.files for p in _parents(entry.path)):
            raise ValueError("a path is listed both as a file and as a directory")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): equal manifests give equal digests."""
        wire = self.model_dump(mode="json", by_alias=True)
        return json.dumps(wire, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return digest_of(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} accepted")
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors()
            )
            raise ManifestError(f"invalid manifest: {problems}") from e

    def check_allowed(self, *, allow_pickle: bool) -> None:
        for entry in self.files:
            check_file_allowed(entry.path, allow_pickle=allow_pickle)


def _parents(path: str) -> Iterable[str]:
    parts = path.split("/")
    return ("/".join(parts[:i]) for i in range(1, len(parts)))


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def list_model_files(src: Path, exclude: Iterable[str] = ()) -> list[str]:
    """Relative POSIX paths of the regular files under ``src``, sorted.

    Hidden entries (``.git``, ``.cache``, ``.gitattributes``) are not model files and are skipped;
    a symlink is refused, since it could point anywhere on the machine that runs populate.
    """
    if not src.is_dir():
        raise SourceUnavailableError(f"{src}: not a directory")
    patterns = tuple(exclude)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        base = Path(dirpath)
        for name in [*dirnames, *filenames]:
            if (base / name).is_symlink():
                raise UnsafePathError(f"{(base / name).relative_to(src)}: symlinks are not uploaded (copy the file)")
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            rel = (base / name).relative_to(src).as_posix()
            if any(fnmatch.fnmatch(rel, p) for p in patterns):
                continue
            found.append(rel)
    return found


def build_manifest(
    src: Path,
    *,
    model_id: str,
    revision: str | None,
    allow_pickle: bool,
    exclude: Iterable[str] = (),
    hash_workers: int = 2,
) -> Manifest:
    """Hash every accepted file under ``src`` (in parallel: hashlib releases the GIL)."""
    paths = list_model_files(src, exclude)
    if not paths:
        raise SourceUnavailableError(f"{src}: no model files found")
    for rel in paths:
        check_file_allowed(rel, allow_pickle=allow_pickle)
    with ThreadPoolExecutor(max_workers=max(1, hash_workers)) as pool:
        digests = list(pool.map(lambda rel: sha256_file(src / rel), paths))
    files = tuple(
        ManifestFile(path=rel, size_bytes=(src / rel).stat().st_size, sha256=sha)
        for rel, sha in zip(paths, digests, strict=True)
    )
    return Manifest(model_id=model_id, revision=revision, files=files)
