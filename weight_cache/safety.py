"""What may be cached and where it may land: file-type policy and path checks. Pure functions,
except ``resolve_inside``, which looks at the filesystem to catch symlinks."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Literal

from kvfleet.weight_cache.errors import DisallowedFileError, UnsafePathError

FileKind = Literal["allowed", "pickle", "other"]

# Weights, configs, tokenizers, chat templates and documentation. Everything else (Python code for
# trust_remote_code, archives, unknown binaries) needs an explicit decision by whoever populates.
ALLOWED_SUFFIXES = frozenset(
    {".safetensors", ".json", ".jsonl", ".txt", ".md", ".model", ".tiktoken", ".vocab", ".spm", ".jinja"}
)
ALLOWED_NAMES = frozenset({"LICENSE", "NOTICE", "README", "COPYING", "USE_POLICY"})
# torch.load unpickles these: loading one can run arbitrary code.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})

MAX_PATH_CHARS = 1024
MAX_SEGMENT_CHARS = 255
# Names the cache itself uses inside a destination directory; a model file may not take them.
RESERVED_PREFIX = ".kvfleet"
_CONTROL = re.compile(r"[\x00-\x1f\x7f\\]")


def classify(path: str) -> FileKind:
    """Whether a relative path names an accepted file, a pickle-based one, or something else."""
    name = PurePosixPath(path).name
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        return "pickle"
    if suffix in ALLOWED_SUFFIXES or name in ALLOWED_NAMES:
        return "allowed"
    return "other"


def check_file_allowed(path: str, *, allow_pickle: bool) -> None:
    kind = classify(path)
    if kind == "pickle" and not allow_pickle:
        raise DisallowedFileError(
            f"{path}: pickle-based weights can run arbitrary code when loaded; convert the model to "
            "safetensors or allow pickle explicitly (--allow-pickle / allow_pickle=True)"
        )
    if kind == "other":
        raise DisallowedFileError(
            f"{path}: not a safetensors, JSON, text or tokenizer file; accepted suffixes are "
            + ", ".join(sorted(ALLOWED_SUFFIXES))
            + " (exclude it, or convert it)"
        )


def check_relative_path(path: str) -> str:
    """A manifest path or key suffix: relative, POSIX, no '..', no empty or reserved segments."""
    if not path or len(path) > MAX_PATH_CHARS:
        raise UnsafePathError(f"{path!r}: path must be 1-{MAX_PATH_CHARS} characters")
    if _CONTROL.search(path):
        raise UnsafePathError(f"{path!r}: path must not contain control characters or backslashes")
    if path.startswith("/"):
        raise UnsafePathError(f"{path!r}: path must be relative (no leading '/')")
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise UnsafePathError(f"{path!r}: path must not contain empty, '.' or '..' segments")
        if len(segment) > MAX_SEGMENT_CHARS:
            raise UnsafePathError(f"{path!r}: a path segment is longer than {MAX_SEGMENT_CHARS} characters")
    if path.split("/", 1)[0].startswith(RESERVED_PREFIX):
        raise UnsafePathError(f"{path!r}: names starting with {RESERVED_PREFIX!r} are reserved for the cache")
    return path


def check_key_prefix(prefix: str) -> str:
    """An object-key prefix (without the trailing '/'); empty means the bucket root."""
    if prefix == "":
        return prefix
    if _CONTROL.search(prefix) or prefix.startswith("/"):
        raise UnsafePathError(f"{prefix!r}: key prefix must be relative and free of control characters")
    if any(segment in ("", ".", "..") for segment in prefix.split("/")):
        raise UnsafePathError(f"{prefix!r}: key prefix must not contain empty, '.' or '..' segments")
    return prefix


def resolve_inside(root: Path, relative: str) -> Path:
    """``root / relative``, refusing a path that leaves ``root`` through '..' or an existing symlink."""
    check_relative_path(relative)
    base = root.resolve()
    target = base.joinpath(*relative.split("/"))
    # Resolving follows any symlink already in the tree (a planted link in DEST, say).
    if not target.resolve().is_relative_to(base):
        raise UnsafePathError(f"{relative}: resolves outside {root} (through a symlink)")
    return target
