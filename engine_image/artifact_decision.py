"""Whether fetching an engine artifact beats rebuilding it: a pure decision from measured times.

An artifact replaces start-up work (a compile) that was timed when it was built
(``buildSeconds`` in its sidecar). Fetching it costs its size over the rate this node gets from
the bucket, measured rather than assumed where possible: this launch's own weight pull, else the
rate recorded on this node by its last fetch, else a configured default. A restored compile
cache is not free either: the engine still traces and loads its graphs, which took a fraction of
the cold compile when measured (docs/benchmarks/cold_start.md), so that fraction is subtracted
from what the artifact saves. The artifact is used only when the expected fetch, with a safety
margin, is shorter than what it saves; an artifact on the node's own disk costs no fetch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Fewer bytes than this make a rate too noisy to trust (one request's latency dominates).
MIN_RATE_SAMPLE_BYTES = 16 << 20


@dataclass(frozen=True)
class DecisionSettings:
    """Bounds of the decision. Units in the names."""

    # Used when nothing was measured on this node yet: a same-datacenter bucket, conservatively.
    assumed_fetch_rate_bytes_per_s: float = 100e6
    # Per-artifact fixed cost: sidecar read, first-byte latency, tar extraction set-up.
    fetch_overhead_s: float = 0.5
    # Fetch time is multiplied by this before comparing: a slower-than-measured link must not
    # make the start slower than rebuilding.
    safety_factor: float = 1.5
    # What loading from a restored cache still costs, as a fraction of the cold build.
    hit_cost_fraction: float = 0.4

    def __post_init__(self) -> None:
        if not 1e3 <= self.assumed_fetch_rate_bytes_per_s <= 1e12:
            raise ValueError("assumed_fetch_rate_bytes_per_s must be in [1 kB/s, 1 TB/s]")
        if not 0 <= self.fetch_overhead_s <= 60:
            raise ValueError("fetch_overhead_s must be in [0, 60]")
        if not 1 <= self.safety_factor <= 10:
            raise ValueError("safety_factor must be in [1, 10]")
        if not 0 <= self.hit_cost_fraction < 1:
            raise ValueError("hit_cost_fraction must be in [0, 1)")


@dataclass(frozen=True)
class FetchRate:
    bytes_per_s: float
    source: str  # "this launch's weight pull", "node record", "assumed"


@dataclass(frozen=True)
class ArtifactDecision:
    use: bool
    reason: str
    expected_fetch_s: float
    expected_saving_s: float | None


def measured_rate(bytes_moved: int, seconds: float, source: str) -> FetchRate | None:
    """A rate from one transfer, or None when it is too small to mean anything."""
    if bytes_moved < MIN_RATE_SAMPLE_BYTES or seconds <= 0:
        return None
    return FetchRate(bytes_moved / seconds, source)


def choose_rate(candidates: list[FetchRate | None], settings: DecisionSettings) -> FetchRate:
    """The first measured rate, else the assumed one."""
    for rate in candidates:
        if rate is not None:
            return rate
    return FetchRate(settings.assumed_fetch_rate_bytes_per_s, "assumed")


def decide(
    size_bytes: int, build_seconds: float | None, rate: FetchRate, settings: DecisionSettings
) -> ArtifactDecision:
    """Use the artifact in the bucket, or rebuild; the reason says which numbers decided."""
    fetch_s = settings.fetch_overhead_s + size_bytes / rate.bytes_per_s
    mb_per_s = rate.bytes_per_s / 1e6
    fetch_text = f"fetching {size_bytes / 1e6:.1f} MB at {mb_per_s:.0f} MB/s ({rate.source}) takes ~{fetch_s:.2f} s"
    if build_seconds is None:
        # Pushed without a build time (older launchers): the only safe guess is that it pays.
        return ArtifactDecision(True, f"{fetch_text}; the artifact records no build time, so it is used", fetch_s, None)
    saving_s = build_seconds * (1 - settings.hit_cost_fraction)
    use = fetch_s * settings.safety_factor < saving_s
    verdict = "used" if use else "not used: rebuilding is faster"
    reason = (
        f"{fetch_text} (x{settings.safety_factor:g} margin) against ~{saving_s:.2f} s saved of a "
        f"{build_seconds:.2f} s build: {verdict}"
    )
    return ArtifactDecision(use, reason, fetch_s, saving_s)


RATE_FILE = ".fetch-rate.json"


def read_node_rate(artifacts_root: Path) -> FetchRate | None:
    """The bucket rate this node measured last (any launch on it), if recorded."""
    try:
        doc = json.loads((artifacts_root / RATE_FILE).read_text())
        rate = float(doc["bytesPerSecond"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return FetchRate(rate, "node record") if rate > 0 else None


def record_node_rate(artifacts_root: Path, rate: FetchRate) -> None:
    artifacts_root.mkdir(parents=True, exist_ok=True)
    tmp = artifacts_root / f".tmp-{os.getpid()}-{RATE_FILE}"
    tmp.write_text(json.dumps({"bytesPerSecond": rate.bytes_per_s, "source": rate.source}))
    os.replace(tmp, artifacts_root / RATE_FILE)
