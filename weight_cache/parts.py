"""How one file is fetched: the ranged GETs it is split into, and the delay before a retry.

Pure planning, no I/O, so the sizes and delays are checked by hand in tests/weight_cache/test_rules.py
and the benchmark plans the same parts the pull does."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.weight_cache.settings import PullSettings


@dataclass(frozen=True)
class Part:
    index: int
    start: int
    length: int

    @property
    def http_range(self) -> str:
        return f"bytes={self.start}-{self.start + self.length - 1}"


def plan_parts(size_bytes: int, part_size_bytes: int) -> tuple[Part, ...]:
    """Split a file into ranged GETs: full parts, then the remainder."""
    if part_size_bytes <= 0:
        raise ValueError("part_size_bytes must be positive")
    return tuple(
        Part(index=i, start=start, length=min(part_size_bytes, size_bytes - start))
        for i, start in enumerate(range(0, size_bytes, part_size_bytes))
    )


def backoff_s(attempt: int, settings: PullSettings) -> float:
    """Delay before retry number ``attempt`` (1-based): exponential, capped."""
    return float(min(settings.retry_backoff_max_s, settings.retry_backoff_s * 2 ** (attempt - 1)))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def fetch_rank(path: str) -> tuple[bool, str]:
    """The order files are fetched in: the small files an engine reads first (config, tokenizer,
    the shard index), then the weights in name order, the order loaders read shards in; so an
    engine that loads as files land (kvfleet.weight_stream) waits as little as possible."""
    return (path.endswith(WEIGHT_SUFFIXES), path)
