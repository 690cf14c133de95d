"""The node cache's eviction decision, pure: entries in, the digests to evict and why out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEntry:
    digest: str
    size_bytes: int
    last_used_s: float
    in_use: bool  # a live process holds a lease on it
    busy: bool  # another process holds its lock (pulling it, or evicting it)


@dataclass(frozen=True)
class EvictionPlan:
    evict: tuple[str, ...]
    fits: bool
    reason: str


def plan_eviction(entries: Sequence[CacheEntry], need_bytes: int, limit_bytes: int | None) -> EvictionPlan:
    """Least recently used first, never an entry in use or busy; evict only as much as needed."""
    used = sum(e.size_bytes for e in entries)
    if limit_bytes is None:
        return EvictionPlan((), True, "no size limit")
    if used + need_bytes <= limit_bytes:
        return EvictionPlan((), True, f"{used} + {need_bytes} bytes fit the {limit_bytes}-byte limit")
    candidates = sorted((e for e in entries if not e.in_use and not e.busy), key=lambda e: (e.last_used_s, e.digest))
    evict: list[str] = []
    for entry in candidates:
        if used + need_bytes <= limit_bytes:
            break
        evict.append(entry.digest)
        used -= entry.size_bytes
    if used + need_bytes <= limit_bytes:
        return EvictionPlan(
            tuple(evict), True, f"evicting {len(evict)} least recently used models to fit {need_bytes} bytes"
        )
    pinned = [e.digest[:12] for e in entries if e.in_use or e.busy]
    return EvictionPlan(
        tuple(evict),
        False,
        f"{need_bytes} bytes do not fit the {limit_bytes}-byte limit even after evicting every idle model; "
        f"{used} bytes stay held by models in use or being pulled ({', '.join(pinned) or 'none'})",
    )
