"""Typed, validated settings of the weight cache. Units are in the field names; every field has
bounds, and the defaults say why they are what they are."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class S3Settings(_Settings):
    """Which S3 server to talk to and how. Credentials are never fields here: they come from boto3's
    standard chain (environment, shared files, instance roles) or a mounted Secret directory."""

    endpoint_url: Annotated[str, StringConstraints(pattern=r"^https?://\S+$", max_length=512)] | None = Field(
        default=None,
        description="Overrides boto3's standard configuration (AWS_ENDPOINT_URL, config files) when set.",
    )
    region: Annotated[str, StringConstraints(max_length=64)] | None = None
    credentials_dir: Path | None = Field(
        default=None,
        description="Directory of a mounted Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY "
        "(and optionally AWS_SESSION_TOKEN) files; unset means boto3's standard chain.",
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, le=300)
    # A 64 MiB part at 100 MB/s takes < 1 s; 60 s only fires on a stalled connection.
    read_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # botocore's "standard" retry mode handles throttling and 5xx on the request itself.
    request_attempts: int = Field(default=5, ge=1, le=20)


class PullSettings(_Settings):
    """How a model is downloaded: ranged GETs across and within files."""

    # Ranged GETs in flight at once, across all files. S3 serves ~100 MB/s per connection, so
    # 8 connections fill a 10 Gb/s link; the loopback benchmark in docs/benchmarks agrees.
    concurrency: int = Field(default=8, ge=1, le=64)
    # Large enough that per-request latency (tens of ms on S3) is a small share of a part's
    # transfer time; small enough that 8 parts in flight spread over several files. Parts are
    # streamed, so a large part costs no memory: servers that charge per request (moto reads the
    # whole object for every ranged GET) are served best by a part size >= the largest file.
    part_size_bytes: int = Field(default=32 * MiB, ge=64 * KiB, le=64 * GiB)
    # Each worker reads, writes and hashes a part in chunks of this size: memory in use is
    # about concurrency x stream_chunk_bytes (64 MiB by default), whatever the part size.
    stream_chunk_bytes: int = Field(default=8 * MiB, ge=64 * KiB, le=256 * MiB)
    # Attempts of one ranged GET on a retryable failure (connection reset, short read, 5xx).
    part_attempts: int = Field(default=4, ge=1, le=20)
    # Whole-file downloads after a sha256 mismatch before the pull fails naming the file.
    file_attempts: int = Field(default=2, ge=1, le=10)
    retry_backoff_s: float = Field(default=0.5, ge=0, le=60, description="First retry delay; doubles per attempt.")
    retry_backoff_max_s: float = Field(default=10.0, ge=0, le=600)
    allow_pickle: bool = Field(default=False, description="Accept pickle-based weights (.bin/.pt/.pth).")
    # What a node-cache hit checks before the model is used (docs/weight_cache.md, "Hits"):
    # "sha256" rehashes every file against the manifest (about 1 s per GB per hashing thread on a
    # shared 2-core machine, docs/benchmarks/node_cache_verify.md);
    # "stat" rehashes only files whose (inode, size, mtime_ns, ctime_ns) differ from what the cache
    # recorded when it last verified them (milliseconds). A file's size alone is never enough.
    verify_on_hit: Literal["sha256", "stat"] = "sha256"
    # Files hashed at once on a hit (hashlib releases the GIL): a GPU node's NVMe feeds several
    # cores; the pull's own workers are idle while a hit is checked.
    hash_workers: int = Field(default=4, ge=1, le=64)
    # Each finished file is fsynced before its atomic rename so a crash never leaves a torn file
    # (docs/benchmarks/weight_cache.md prices it).
    fsync: bool = True
    # With fsync: start each chunk's writeback as it is written (Linux's sync_file_range, through
    # libc), so the disk works during the download and the fsync finds little left; off, the fsync
    # flushes the whole file at its end. Chosen by docs/benchmarks/weight_cache.md.
    start_writeback: bool = True

    @model_validator(mode="after")
    def _backoff_ordered(self) -> PullSettings:
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError("retry_backoff_max_s must be >= retry_backoff_s")
        return self


class ProgressSettings(_Settings):
    """How a pull's rate and time left are estimated (``PullTracker``)."""

    # Long enough to smooth the bursts of parallel ranged GETs finishing together, short enough
    # that a stall shows within half a minute.
    rate_window_s: float = Field(default=20.0, gt=0, le=600)
    # A sample at most this often: ~40 kept per window; also the shortest span a rate is given for.
    sample_interval_s: float = Field(default=0.5, gt=0, le=60)

    @property
    def max_samples(self) -> int:
        """What the window needs (one base sample before it, one per interval in it), hard-capped."""
        return min(4096, int(self.rate_window_s / self.sample_interval_s) + 3)

    @model_validator(mode="after")
    def _interval_inside_window(self) -> ProgressSettings:
        if self.sample_interval_s > self.rate_window_s:
            raise ValueError("sample_interval_s must be <= rate_window_s")
        return self


class PopulateSettings(_Settings):
    """How a model is uploaded: multipart, parallel across and within files."""

    concurrency: int = Field(default=8, ge=1, le=64)
    # S3 allows at most 10,000 parts per object: 64 MiB parts cover objects up to 625 GiB.
    part_size_bytes: int = Field(default=64 * MiB, ge=5 * MiB, le=5 * GiB)
    allow_pickle: bool = False
    exclude: tuple[Annotated[str, StringConstraints(min_length=1, max_length=256)], ...] = Field(
        default=(), max_length=64, description="Glob patterns (relative paths) left out of the upload."
    )


class NodeCacheSettings(_Settings):
    """The node-level cache directory: where models live, how big it may get, how long to wait."""

    size_limit_bytes: int | None = Field(
        default=None, ge=1, description="Least recently used models not in use are evicted above this."
    )
    # Another process may be downloading the same model; a 2 GB/s pull of a 140 GB model takes
    # ~70 s, a slow 100 MB/s one ~25 min, so the default waits up to an hour.
    lock_timeout_s: float = Field(default=3600.0, gt=0, le=86_400)
    lock_poll_s: float = Field(default=0.2, gt=0, le=10)
