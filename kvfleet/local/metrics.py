"""What local mode's view shows from the engines' metrics: rates and quantiles over a window.

The samples are the ones the autoscaler's control loop scraped for its decision (the parser is
the autoscaler's ``parse_engine_metrics``, the quantile its ``histogram_quantile``), so the view
costs no scrape of its own. What is here is the arithmetic: counters per replica turned into
deltas (a replica that restarts or is new starts from zero, as Prometheus' ``increase``
assumes), summed over a sliding window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfleet.autoscaler.engine_metrics import EngineSample
from kvfleet.autoscaler.scrape_source import histogram_quantile


@dataclass(frozen=True)
class WindowStats:
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    prefix_hit_rate: float | None
    queue_depth: float
    running: float


@dataclass
class _Delta:
    at_s: float
    requests: float
    queries: float
    hits: float
    buckets: dict[float, float]


@dataclass
class MetricWindow:
    """Deltas of per-replica counters over the last ``window_s`` seconds (bounded by time)."""

    window_s: float = 30.0
    _last: dict[str, EngineSample] = field(default_factory=dict)
    _deltas: deque[_Delta] = field(default_factory=deque)
    _gauges: tuple[float, float] = (0.0, 0.0)

    def observe(self, now_s: float, samples: Mapping[str, EngineSample]) -> None:
        """Record one scrape of every current replica (keyed by replica id)."""
        delta = _Delta(now_s, 0.0, 0.0, 0.0, {})
        for key, sample in samples.items():
            before = self._last.get(key, EngineSample())
            if _was_reset(before, sample):
                before = EngineSample()
            delta.requests += _increase(before.requests_done, sample.requests_done)
            delta.queries += _increase(before.prefix_queries, sample.prefix_queries)
            delta.hits += _increase(before.prefix_hits, sample.prefix_hits)
            for bound, count in sample.ttft_buckets.items():
                delta.buckets[bound] = delta.buckets.get(bound, 0.0) + _increase(
                    before.ttft_buckets.get(bound, 0.0), count
                )
        self._last = dict(samples)
        self._gauges = (
            sum(s.waiting or 0.0 for s in samples.values()),
            sum(s.running or 0.0 for s in samples.values()),
        )
        self._deltas.append(delta)
        while self._deltas and self._deltas[0].at_s < now_s - self.window_s:
            self._deltas.popleft()

    @property
    def replicas(self) -> set[str]:
        """The replicas of the last observation (those that answered their scrape)."""
        return set(self._last)

    def stats(self) -> WindowStats:
        deltas = list(self._deltas)
        span_s = (deltas[-1].at_s - deltas[0].at_s) if len(deltas) > 1 else 0.0
        # The first delta in the window covers time before the window; leave its requests out of the rate.
        requests = sum(d.requests for d in deltas[1:])
        queries = sum(d.queries for d in deltas)
        hits = sum(d.hits for d in deltas)
        buckets: dict[float, float] = {}
        for d in deltas:
            for bound, count in d.buckets.items():
                buckets[bound] = buckets.get(bound, 0.0) + count
        return WindowStats(
            requests_per_s=requests / span_s if span_s > 0 else 0.0,
            ttft_p50_s=histogram_quantile(0.5, buckets),
            ttft_p99_s=histogram_quantile(0.99, buckets),
            prefix_hit_rate=hits / queries if queries > 0 else None,
            queue_depth=self._gauges[0],
            running=self._gauges[1],
        )


def _was_reset(before: EngineSample, after: EngineSample) -> bool:
    # Any counter that went down means the process restarted: all its counters start from zero.
    pairs = [
        (before.requests_done, after.requests_done),
        (before.prefix_queries, after.prefix_queries),
        (before.prefix_hits, after.prefix_hits),
        *((count, after.ttft_buckets.get(bound, 0.0)) for bound, count in before.ttft_buckets.items()),
    ]
    return any(a < b for b, a in pairs)


def _increase(before: float, after: float) -> float:
    return after - before if after >= before else after
