"""How far a weight pull is: the report the launcher logs and serves, and the operator reads.

Pure and dependency-free, so the launcher (which writes it) and the operator (which reads it from a
tenant's pod, and so checks every field) share one definition and one way of saying it:
``pulling 42% (58/140 GB), 1.20 GB/s, 1m10s left``. Sizes are decimal (1 GB = 10^9 bytes), the way
`kvfleet cache` and object stores print them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Bounds on what a report may claim; a pod is a tenant's, so anything outside is refused.
MAX_TOTAL_BYTES = 1 << 50  # 1 PiB: ten times the largest open model with every shard
MAX_RATE_BYTES_PER_S = 1e12  # 1 TB/s: beyond any NIC a node has
MAX_ETA_S = 30 * 86_400.0  # a month: past that the figure means nothing

_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


@dataclass(frozen=True)
class PullReport:
    """One moment of a pull: bytes in place of the total, bytes moved, rate and time left."""

    total_bytes: int  # what the model's files hold
    done_bytes: int  # in place: files already on the node, resumed parts and downloaded bytes
    downloaded_bytes: int  # moved over the network by this pull (retries included)
    rate_bytes_per_s: float | None  # over the recent window; None before a window's worth of time
    eta_s: float | None  # time left at that rate; None when the rate is unknown or zero

    @property
    def percent(self) -> int:
        """Whole percent done, rounded down: 100 only when every byte is in place."""
        if self.total_bytes <= 0:
            return 100
        return min(100, self.done_bytes * 100 // self.total_bytes)

    def fraction_text(self) -> str:
        """``58/140 GB``: both in the total's unit, done rounded down so it never looks finished early."""
        scale, unit = 1.0, "B"
        for name, size in _UNITS:
            if self.total_bytes >= size:
                scale, unit = size, name
                break
        decimals = 0 if self.total_bytes / scale >= 10 or unit == "B" else 1
        step = 10**decimals
        done = math.floor(self.done_bytes / scale * step) / step
        total = round(self.total_bytes / scale, decimals)
        return f"{done:.{decimals}f}/{total:.{decimals}f} {unit}"

    def summary(self) -> str:
        """``pulling 42% (58/140 GB), 1.20 GB/s, 1m10s left``; the rate and time only when known."""
        parts = [f"pulling {self.percent}% ({self.fraction_text()})"]
        if self.rate_bytes_per_s is not None:
            parts.append(rate_text(self.rate_bytes_per_s))
        if self.eta_s is not None:
            parts.append(f"{duration_text(self.eta_s)} left")
        return ", ".join(parts)

    def to_doc(self) -> dict[str, Any]:
        """The wire form (the launcher's ``/progress``; docs/contracts.md)."""
        return {
            "totalBytes": self.total_bytes,
            "doneBytes": self.done_bytes,
            "downloadedBytes": self.downloaded_bytes,
            "bytesPerSecond": None if self.rate_bytes_per_s is None else round(self.rate_bytes_per_s, 1),
            "etaSeconds": None if self.eta_s is None else round(self.eta_s, 1),
        }


def rate_text(bytes_per_s: float) -> str:
    for name, size in _UNITS:
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.2f} {name}/s"
    return f"{bytes_per_s:.0f} B/s"


def duration_text(seconds: float) -> str:
    """``45 s``, ``3m05s``, ``2h07m``: short enough for a condition message."""
    whole = math.ceil(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _count(value: Any, bound: float) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
        return None
    return value


def _optional_float(value: Any, bound: float) -> tuple[bool, float | None]:
    """(valid, value): None is a valid "unknown"."""
    if value is None:
        return True, None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False, None
    if not math.isfinite(value) or not 0 <= value <= bound:
        return False, None
    return True, float(value)


def parse_report(doc: Any) -> PullReport | None:
    """A report from its wire form, or None when any field is missing, mistyped or out of bounds."""
    if not isinstance(doc, dict):
        return None
    total = _count(doc.get("totalBytes"), MAX_TOTAL_BYTES)
    if total is None:
        return None
    done = _count(doc.get("doneBytes"), total)
    # Retries move bytes twice, so what moved may exceed the total (boundedly).
    downloaded = _count(doc.get("downloadedBytes"), 4 * MAX_TOTAL_BYTES)
    rate_ok, rate = _optional_float(doc.get("bytesPerSecond"), MAX_RATE_BYTES_PER_S)
    eta_ok, eta = _optional_float(doc.get("etaSeconds"), MAX_ETA_S)
    if done is None or downloaded is None or not rate_ok or not eta_ok:
        return None
    return PullReport(total, done, downloaded, rate, eta)
