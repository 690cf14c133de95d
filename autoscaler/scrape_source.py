"""Observations from a direct scrape of the engines' and the router's ``/metrics`` (local mode).

No Prometheus in between, so this source does what PromQL would: sums and means over engines,
the arrival rate from the change of the router's request counter between two scrapes, and the
TTFT p90 from the change of the engines' histogram buckets (``histogram_quantile``'s linear
interpolation). It keeps the previous counters per deployment, bounded.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.promql import MetricNames
from kvfleet.autoscaler.sources import SourceError, Target

MAX_METRICS_BYTES = 4 * 1024 * 1024


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
    """A ``MetricSource`` that reads /metrics endpoints directly."""

    def __init__(self, settings: ScrapeSourceSettings, session: aiohttp.ClientSession | None = None) -> None:
        self.settings = settings
        self._session = session
        self._owns_session = session is None
        self._previous: OrderedDict[str, _Counters] = OrderedDict()

    async def _fetch(self, base_url: str) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = base_url.rstrip("/") + "/metrics"
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
            async with self._session.get(url, timeout=timeout) as response:
                if response.status != 200:
                    raise SourceError(f"{url} answered {response.status}")
                body = await response.content.read(MAX_METRICS_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise SourceError(f"{url} unreachable ({type(e).__name__})") from e
        if len(body) > MAX_METRICS_BYTES:
            raise SourceError(f"{url} returned more than {MAX_METRICS_BYTES} bytes")
        return body.decode("utf-8", errors="replace")

    async def observe(self, target: Target, now_s: float) -> Observation:
        try:
            return await self._observe(target, now_s)
        except SourceError as e:
            return Observation.failed(now_s, str(e), ready_replicas=target.ready_replicas)
        except ValueError as e:  # the exposition parser's error for a malformed payload
            return Observation.failed(now_s, f"malformed metrics: {str(e)[:200]}", ready_replicas=target.ready_replicas)

    async def _observe(self, target: Target, now_s: float) -> Observation:
        names = self.settings.names
        model = target.served_name
        urls = list(target.engine_urls)
        router = self.settings.router_url
        texts = await asyncio.gather(*(self._fetch(u) for u in [*urls, *([router] if router else [])]))
        engine_texts, router_text = texts[: len(urls)], (texts[len(urls)] if router else None)

        concurrency: float | None = None
        kv: list[float] = []
        ttft_buckets: dict[float, float] = {}
        running_waiting = {
            names.engine_running_waiting_regex.replace("(running|waiting)", w) for w in ("running", "waiting")
        }
        for text in engine_texts:
            for s in _samples(text):
                if s.labels.get("model_name", model) != model:
                    continue
                if s.name in running_waiting:
                    concurrency = (concurrency or 0.0) + s.value
                elif s.name == names.kv_cache_usage:
                    kv.append(s.value)
                elif s.name == names.ttft_bucket:
                    le = float(s.labels["le"])
                    ttft_buckets[le] = ttft_buckets.get(le, 0.0) + s.value

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
            engine_concurrency=concurrency if urls else None,
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
