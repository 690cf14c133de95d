"""The weight cache's error tree. Callers catch ``WeightCacheError``; botocore, tarfile and OS errors
are translated into it at the boundary that knows which file or object they concern."""

from __future__ import annotations


class WeightCacheError(Exception):
    """Base of every error the weight cache raises on purpose."""


class InvalidLocationError(WeightCacheError, ValueError):
    """An s3:// or hf:// URI, a key prefix or a directory that cannot be used."""


class UnsafePathError(WeightCacheError):
    """A manifest path, object key or tar member that would escape its directory."""


class DisallowedFileError(WeightCacheError):
    """A file type that is not accepted (pickle-based weights, code, unknown types)."""


class ManifestError(WeightCacheError):
    """The manifest is missing, malformed or not the one that was asked for."""


class DigestMismatchError(ManifestError):
    """The manifest's digest is not the one the caller pinned (``expected_digest``)."""

    def __init__(self, message: str, *, found: str, expected: str) -> None:
        super().__init__(message)
        self.found = found
        self.expected = expected


class SourceUnavailableError(WeightCacheError):
    """The model source cannot be read (hub unreachable, directory missing)."""


class TransferError(WeightCacheError):
    """A file could not be transferred; ``path`` names it (relative to the model root)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class PullStoppedError(WeightCacheError):
    """The caller stopped the pull (its engine is gone): the workers ended between chunks, the
    partial files and their journal stay in staging for a later pull to resume from."""


class ChecksumMismatchError(TransferError):
    """The downloaded bytes do not hash to the manifest's sha256 (after all retries)."""


class ObjectChangedError(TransferError):
    """The object changed on the server while it was being downloaded (ETag or size differs)."""


class NodeCacheError(WeightCacheError):
    """The node cache cannot serve a pull."""


class NodeCacheFullError(NodeCacheError):
    """The size bound cannot be met without evicting models that are in use."""


class DiskFullError(NodeCacheError):
    """The disk under the destination has no room for the model's bytes; nothing partial is left."""


class LockTimeoutError(NodeCacheError):
    """Another process held the model's lock longer than the configured wait."""


class ArtifactError(WeightCacheError):
    """An engine artifact cannot be pushed (pulls report problems as misses instead)."""
