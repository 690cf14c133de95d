"""Progress subscribers: transfers report to them and never draw anything themselves. Methods are
called from worker threads, so implementations must be thread-safe.

:class:`PullTracker` is the subscriber a long-running process (the engine launcher) reads from:
bytes in place of the total, the network rate over a recent window and the time left, as a
:class:`~kvfleet.pull_progress.PullReport`. Its arithmetic is the pure :func:`window_rate` and
:func:`eta_seconds`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfleet.pull_progress import PullReport
from kvfleet.weight_cache.settings import ProgressSettings


class TransferProgress(Protocol):
    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        """Called once: the bytes the transfer covers and how many are already in place."""

    def on_bytes(self, count: int) -> None:
        """Called as bytes move over the network."""

    def on_resumed(self, count: int) -> None:
        """Called for bytes an earlier, interrupted transfer already wrote: done, but not moved now."""

    def on_file_done(self, path: str, size_bytes: int) -> None:
        """Called when a file is complete and verified."""


class NullProgress:
    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        pass

    def on_bytes(self, count: int) -> None:
        pass

    def on_resumed(self, count: int) -> None:
        pass

    def on_file_done(self, path: str, size_bytes: int) -> None:
        pass


class CountingProgress:
    """Totals only; handy for callers (and tests) that want numbers, not a bar."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total_bytes = 0
        self.done_at_start_bytes = 0
        self.transferred_bytes = 0
        self.resumed_bytes = 0
        self.files_done: list[str] = []

    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        with self._lock:
            self.total_bytes = total_bytes
            self.done_at_start_bytes = done_bytes

    def on_bytes(self, count: int) -> None:
        with self._lock:
            self.transferred_bytes += count

    def on_resumed(self, count: int) -> None:
        with self._lock:
            self.resumed_bytes += count

    def on_file_done(self, path: str, size_bytes: int) -> None:
        with self._lock:
            self.files_done.append(path)


@dataclass(frozen=True)
class Sample:
    """Bytes moved over the network by ``at_s`` (monotonic seconds)."""

    at_s: float
    moved_bytes: int


def window_rate(
    samples: Sequence[Sample], now_s: float, moved_bytes: int, window_s: float, min_span_s: float
) -> float | None:
    """Bytes per second from the newest sample at least ``window_s`` old (the oldest one while the
    transfer is younger than the window) to ``now``. None with no sample or a span under
    ``min_span_s``: a rate over a few milliseconds says nothing. A stall shows as a falling rate
    that reaches 0 once the window holds no new bytes."""
    if not samples:
        return None
    base = samples[0]
    for sample in samples:
        if sample.at_s > now_s - window_s:
            break
        base = sample
    span = now_s - base.at_s
    if span < min_span_s or span <= 0:
        return None
    return max(0, moved_bytes - base.moved_bytes) / span


def eta_seconds(remaining_bytes: int, rate_bytes_per_s: float | None) -> float | None:
    """Time left at ``rate``; 0 when nothing is left; None when the rate is unknown or zero."""
    if remaining_bytes <= 0:
        return 0.0
    if rate_bytes_per_s is None or rate_bytes_per_s <= 0:
        return None
    return remaining_bytes / rate_bytes_per_s


class PullTracker:
    """Counts a pull's bytes as workers report them and answers :meth:`report` at any time.

    Samples for the rate are taken at most every ``sample_interval_s`` and only the ones the window
    needs are kept, so memory is bounded whatever the pull's size or duration. The rate is of bytes
    moved over the network; bytes resumed from an earlier attempt count as done but not as moved,
    so they shorten the time left without inflating the rate.
    """

    def __init__(self, settings: ProgressSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings or ProgressSettings()
        self._clock = clock
        self._lock = threading.Lock()
        self._total_bytes: int | None = None
        self._in_place_at_start = 0
        self._resumed_bytes = 0
        self._moved_bytes = 0
        self._last_sample_s = 0.0
        self._samples: deque[Sample] = deque(maxlen=self._settings.max_samples)

    @property
    def started(self) -> bool:
        return self._total_bytes is not None

    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        now = self._clock()
        with self._lock:
            self._total_bytes, self._in_place_at_start = total_bytes, done_bytes
            self._samples.clear()
            self._samples.append(Sample(now, self._moved_bytes))
            self._last_sample_s = now

    def on_bytes(self, count: int) -> None:
        now = self._clock()
        with self._lock:
            self._moved_bytes += count
            if now - self._last_sample_s >= self._settings.sample_interval_s:
                self._sample(now)

    def on_resumed(self, count: int) -> None:
        with self._lock:
            self._resumed_bytes += count

    def on_file_done(self, path: str, size_bytes: int) -> None:
        pass

    def _sample(self, now: float) -> None:
        self._samples.append(Sample(now, self._moved_bytes))
        self._last_sample_s = now
        # Keep one sample at or before the window's start (the rate's base), drop older ones.
        horizon = now - self._settings.rate_window_s
        while len(self._samples) >= 2 and self._samples[1].at_s <= horizon:
            self._samples.popleft()

    def report(self) -> PullReport | None:
        """Where the pull stands now; None before it started (a node-cache hit never starts one)."""
        now = self._clock()
        with self._lock:
            total = self._total_bytes
            if total is None:
                return None
            moved = self._moved_bytes
            # A retried part moves its bytes twice: done never passes the total.
            done = min(total, self._in_place_at_start + self._resumed_bytes + moved)
            samples = tuple(self._samples)
        rate = window_rate(samples, now, moved, self._settings.rate_window_s, self._settings.sample_interval_s)
        return PullReport(
            total_bytes=total,
            done_bytes=done,
            downloaded_bytes=moved,
            rate_bytes_per_s=rate,
            eta_s=eta_seconds(total - done, rate),
        )


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def throughput_line(verb: str, moved_bytes: int, elapsed_s: float, extra: str = "") -> str:
    rate = moved_bytes / elapsed_s if elapsed_s > 0 else 0.0
    tail = f", {extra}" if extra else ""
    return f"{verb} {human_bytes(moved_bytes)} in {elapsed_s:.2f} s ({human_bytes(rate)}/s){tail}"
