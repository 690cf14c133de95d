"""The pull's rate and time left: pure arithmetic checked by hand, and the tracker with an injected
clock (no sleeping)."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from kvfleet.weight_cache.progress import PullTracker, Sample, eta_seconds, window_rate
from kvfleet.weight_cache.settings import ProgressSettings

MB = 10**6


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("samples", "now", "moved", "rate"),
    [
        ([], 10.0, 0, None),
        # Younger than the window: from the first sample. 100 MB in 5 s.
        ([Sample(0, 0), Sample(2, 40 * MB)], 5.0, 100 * MB, 20 * MB),
        # The base is the newest sample at least 10 s old: (12, 300 MB) -> 200 MB in 10 s.
        ([Sample(0, 0), Sample(6, 100 * MB), Sample(12, 300 * MB), Sample(20, 450 * MB)], 22.0, 500 * MB, 20 * MB),
        # A stall: nothing moved in the last window, the rate is 0.
        ([Sample(0, 0), Sample(5, 100 * MB)], 30.0, 100 * MB, 0.0),
        # Under the shortest span a rate is given for.
        ([Sample(10, 0)], 10.2, 5 * MB, None),
    ],
    ids=["no-sample", "young", "windowed", "stalled", "too-short"],
)
def test_window_rate(samples: list[Sample], now: float, moved: int, rate: float | None) -> None:
    assert window_rate(samples, now, moved, window_s=10.0, min_span_s=0.5) == rate


@pytest.mark.parametrize(
    ("remaining", "rate", "eta"),
    [(100 * MB, 20 * MB, 5.0), (0, None, 0.0), (-5, 1.0, 0.0), (100, None, None), (100, 0.0, None)],
)
def test_eta(remaining: int, rate: float | None, eta: float | None) -> None:
    assert eta_seconds(remaining, rate) == eta


def test_tracker_counts_reused_resumed_and_moved_bytes() -> None:
    clock = Clock()
    tracker = PullTracker(ProgressSettings(rate_window_s=10, sample_interval_s=1), clock=clock)
    assert tracker.report() is None and not tracker.started

    tracker.on_start(total_bytes=1000 * MB, done_bytes=200 * MB)  # files already in place
    tracker.on_resumed(100 * MB)  # parts an interrupted pull wrote: done, not moved
    for second in range(1, 6):
        clock.now = float(second)
        tracker.on_bytes(50 * MB)
    r = tracker.report()
    assert r is not None
    assert (r.total_bytes, r.done_bytes, r.downloaded_bytes) == (1000 * MB, 550 * MB, 250 * MB)
    assert r.rate_bytes_per_s == 50 * MB  # 250 MB moved in 5 s; the resumed 100 MB is not a rate
    assert r.eta_s == 9.0  # 450 MB left at 50 MB/s
    assert r.percent == 55


def test_tracker_rate_follows_the_window_and_a_stall() -> None:
    clock = Clock()
    tracker = PullTracker(ProgressSettings(rate_window_s=10, sample_interval_s=1), clock=clock)
    tracker.on_start(total_bytes=10_000 * MB, done_bytes=0)
    for second in range(1, 31):  # 100 MB/s for 30 s, then 10 MB/s
        clock.now = float(second)
        tracker.on_bytes(100 * MB if second <= 20 else 10 * MB)
    r = tracker.report()
    assert r is not None and r.rate_bytes_per_s == pytest.approx(10 * MB)
    clock.now = 45.0  # nothing for 15 s
    r = tracker.report()
    assert r is not None and r.rate_bytes_per_s == 0.0 and r.eta_s is None


def test_tracker_memory_is_bounded_and_never_passes_the_total() -> None:
    clock = Clock()
    settings = ProgressSettings(rate_window_s=2, sample_interval_s=0.5)
    tracker = PullTracker(settings, clock=clock)
    tracker.on_start(total_bytes=100, done_bytes=0)
    for step in range(10_000):
        clock.now = step * 0.01
        tracker.on_bytes(1)  # 10,000 bytes "moved" for 100: retried parts count again
    assert len(tracker._samples) <= settings.max_samples == 7
    r = tracker.report()
    assert r is not None and r.done_bytes == 100 and r.downloaded_bytes == 10_000 and r.eta_s == 0.0


def test_tracker_is_thread_safe() -> None:
    tracker = PullTracker()
    tracker.on_start(total_bytes=8 * 10_000, done_bytes=0)

    def work() -> None:
        for _ in range(10_000):
            tracker.on_bytes(1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r = tracker.report()
    assert r is not None and r.downloaded_bytes == r.done_bytes == 80_000


@pytest.mark.parametrize(
    "values", [{"rate_window_s": 0}, {"sample_interval_s": 0}, {"rate_window_s": 5, "sample_interval_s": 6}]
)
def test_settings_are_bounded(values: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        ProgressSettings(**values)
