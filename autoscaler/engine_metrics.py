"""One engine's ``/metrics``: fetched with bounds and parsed into an ``EngineSample``.

This is the only parser of the engines' vLLM-named metrics. The scrape source sums the samples of
a deployment's engines into an ``Observation``; local mode hands the samples it scraped for the
decision to its view as well, so each engine is read once per tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.autoscaler.promql import MetricNames
from kvfleet.autoscaler.sources import SourceError

MAX_METRICS_BYTES = 4 * 1024 * 1024
DEFAULT_NAMES = MetricNames()


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one engine, summed over its matching label sets.

    ``None`` for a gauge means the engine exposed no such series (a policy input that must stay
    distinguishable from zero); counters and histogram buckets (cumulative) start at zero.
    """

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: tuple[float, ...] = ()
    """Every ``vllm:kv_cache_usage_perc`` series' value (the observation averages them)."""
    requests_done: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    ttft_buckets: Mapping[float, float] = field(default_factory=dict)

    @property
    def concurrency(self) -> float | None:
        """Requests running + waiting; None when the engine exposed neither."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


def parse_engine_metrics(text: str, model: str | None = None, names: MetricNames = DEFAULT_NAMES) -> EngineSample:
    """The sample of ``model``'s series (``model_name`` label; a series without it counts), or of
    every series when ``model`` is None. Raises ValueError on a malformed exposition."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    kv: list[float] = []
    buckets: dict[float, float] = {}
    counter_names = {names.requests_done, names.prefix_cache_queries, names.prefix_cache_hits}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if model is not None and s.labels.get("model_name", model) != model:
                continue
            if s.name in (names.engine_running, names.engine_waiting):
                gauges[s.name] = gauges.get(s.name, 0.0) + s.value
            elif s.name == names.kv_cache_usage:
                kv.append(s.value)
            elif s.name == names.ttft_bucket:
                bound = float(s.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + s.value
            elif (counter := s.name.removesuffix("_total")) in counter_names and s.name.endswith("_total"):
                counters[counter] = counters.get(counter, 0.0) + s.value
    return EngineSample(
        running=gauges.get(names.engine_running),
        waiting=gauges.get(names.engine_waiting),
        kv_cache_usage=tuple(kv),
        requests_done=counters.get(names.requests_done, 0.0),
        prefix_queries=counters.get(names.prefix_cache_queries, 0.0),
        prefix_hits=counters.get(names.prefix_cache_hits, 0.0),
        ttft_buckets=buckets,
    )


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The text of ``base_url``/metrics; SourceError (no body in it) when it cannot be had."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                raise SourceError(f"{url} answered {response.status}")
            body = await response.content.read(MAX_METRICS_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise SourceError(f"{url} unreachable ({type(e).__name__})") from e
    if len(body) > MAX_METRICS_BYTES:
        raise SourceError(f"{url} returned more than {MAX_METRICS_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


async def scrape_engine(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str | None = None,
    *,
    timeout_s: float = 2.0,
    names: MetricNames = DEFAULT_NAMES,
) -> EngineSample:
    """Fetch and parse one engine's metrics: one GET. SourceError when unreachable or malformed."""
    text = await fetch_metrics(session, base_url, timeout_s)
    try:
        return parse_engine_metrics(text, model, names)
    except ValueError as e:  # the exposition parser's error for a malformed payload
        raise SourceError(f"malformed metrics from {base_url}: {str(e)[:200]}") from e


def total_inflight(samples: Iterable[EngineSample]) -> int:
    """Requests running or waiting in these engines (what a drain waits on)."""
    return int(sum(s.concurrency or 0.0 for s in samples))
