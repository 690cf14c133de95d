"""Observations from a direct scrape of the engines' and the router's ``/metrics`` (local mode).

No Prometheus in between, so this source does what PromQL would: sums and means over engines,
the arrival rate from the change of the router's request counter between two scrapes, and the
TTFT p90 from the change of the engines' histogram buckets (``histogram_quantile``'s linear
interpolation). It keeps the previous counters per deployment, bounded.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvfleet.autoscaler.engine_metrics import EngineSample, fetch_metrics
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.promql import MetricNames
from kvfleet.autoscaler.sources import SourceError, Target


@dataclass(frozen=True)
class ScrapeSourceSettings:
    router_url: str | None = None
    """Base URL of the router (its /metrics is read); None when no router runs."""
    timeout_s: float = 2.0
    max_targets: int = 1024
    """Deployments whose previous counters are remembered (least recently seen are forgotten)."""
    names: MetricNames = field(default_factory=MetricNames)

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 60:
            raise ValueError(f"timeout_s must be in (0, 60], got {self.timeout_s}")
        if not 1 <= self.max_targets <= 100_000:
            raise ValueError(f"max_targets must be in [1, 100000], got {self.max_targets}")


@dataclass(frozen=True)
class _Counters:
    at_s: float
    requests_total: float | None
    ttft_buckets: dict[float, float]


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts {upper bound: count}."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # the +Inf bucket: the highest finite bound, as Prometheus does
            width = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width > 0 else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


def _samples(text: str) -> Iterable[Sample]:
    for family in text_string_to_metric_families(text):
        yield from family.samples


class ScrapeSource:
    """Sums engine samples and the router's /metrics into an observation, as PromQL would."""

    def __init__(self, settings: ScrapeSourceSettings, session: aiohttp.ClientSession | None = None) -> None:
        self.settings = settings
        self._session = session
        self._owns_session = session is None
        self._previous: OrderedDict[str, _Counters] = OrderedDict()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def observe_engines(self, target: Target, now_s: float, engines: Sequence[EngineSample]) -> Observation:
        """The observation from samples of the target's ready engines, plus the router's /metrics.

        The caller scrapes the engines (``engine_metrics.scrape_engine``) because local mode's view
        reads the same samples: each engine is read once per tick."""
        try:
            return await self._observe(target, now_s, engines)
        except SourceError as e:
            return Observation.failed(now_s, str(e), ready_replicas=target.ready_replicas)
        except ValueError as e:  # the exposition parser's error for a malformed payload
            return Observation.failed(now_s, f"malformed metrics: {str(e)[:200]}", ready_replicas=target.ready_replicas)

    async def _observe(self, target: Target, now_s: float, engines: Sequence[EngineSample]) -> Observation:
        names = self.settings.names
        model = target.served_name
        router = self.settings.router_url
        router_text = await fetch_metrics(self._client(), router, self.settings.timeout_s) if router else None

        concurrencies = [c for c in (e.concurrency for e in engines) if c is not None]
        concurrency = sum(concurrencies) if concurrencies else None
        kv = [v for e in engines for v in e.kv_cache_usage]
        ttft_buckets: dict[float, float] = {}
        for e in engines:
            for le, count in e.ttft_buckets.items():
                ttft_buckets[le] = ttft_buckets.get(le, 0.0) + count

        in_flight = queue = requests_total = None
        if router_text is not None:
            for s in _samples(router_text):
                # The router labels per-model series with the deployment's namespace too: another
                # namespace's deployment of the same served name is not this one.
                if s.labels.get("model") != model or s.labels.get("namespace", target.namespace) != target.namespace:
                    continue
                if s.name == names.router_inflight:
                    in_flight = (in_flight or 0.0) + s.value
                elif s.name == names.router_queue_depth:
                    queue = (queue or 0.0) + s.value
                elif s.name == names.router_requests_total:
                    requests_total = (requests_total or 0.0) + s.value

        previous = self._previous.pop(target.key, None)
        self._previous[target.key] = _Counters(now_s, requests_total, ttft_buckets)
        while len(self._previous) > self.settings.max_targets:
            self._previous.popitem(last=False)
        rate: float | None = 0.0 if router_text is not None else None
        ttft: float | None = None
        if previous is not None and now_s > previous.at_s:
            dt = now_s - previous.at_s
            if requests_total is not None:
                # A counter that went down was reset (router restart): count from zero.
                before = previous.requests_total or 0.0
                rate = (requests_total - before if requests_total >= before else requests_total) / dt
            delta = {le: c - previous.ttft_buckets.get(le, 0.0) for le, c in ttft_buckets.items()}
            if all(v >= 0 for v in delta.values()):
                ttft = histogram_quantile(0.9, delta)
        if router_text is not None and queue is None:
            queue = 0.0  # the router drops the gauge of a model with nothing held
        return Observation(
            sampled_at_s=now_s,
            ready_replicas=target.ready_replicas,
            engine_concurrency=concurrency if engines else None,
            router_in_flight=in_flight if in_flight is not None or router_text is None else 0.0,
            queue_depth=queue,
            arrival_rate_rps=rate,
            kv_cache_utilization=sum(kv) / len(kv) if kv else None,
            ttft_p90_s=ttft,
            measured_cold_start_s=target.measured_cold_start_s,
        )

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
