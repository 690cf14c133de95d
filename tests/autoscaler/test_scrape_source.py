"""The direct-scrape source (local mode) against a real /metrics endpoint."""

from __future__ import annotations

import aiohttp
import pytest

from kvfleet.autoscaler.engine_metrics import scrape_engine
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy import decide, initial_state
from kvfleet.autoscaler.scrape_source import ScrapeSource, ScrapeSourceSettings, histogram_quantile
from kvfleet.autoscaler.sources import SourceError, Target
from kvfleet.spec import AutoscalingSpec
from tests.autoscaler.conftest import MODEL, MetricsEndpoint
from tests.conftest import pick_free_port


def target(url: str, ready: int = 1) -> Target:
    return Target(namespace="default", name="chat", served_name=MODEL, ready_replicas=ready, engine_urls=(url,))


async def observe(source: ScrapeSource, target: Target, now_s: float) -> Observation:
    """As local mode's tick does: scrape each engine once, then sum with the router's /metrics."""
    async with aiohttp.ClientSession() as session:
        try:
            engines = [await scrape_engine(session, u, target.served_name, timeout_s=1.0) for u in target.engine_urls]
        except SourceError as e:
            return Observation.failed(now_s, str(e), ready_replicas=target.ready_replicas)
    return await source.observe_engines(target, now_s, engines)


async def test_scrape_sums_rates_and_quantiles(metrics_endpoint: MetricsEndpoint) -> None:
    m = metrics_endpoint
    m.running.labels(MODEL).set(5)
    m.waiting.labels(MODEL).set(2)
    m.running.labels("other").set(100)
    m.kv.labels(MODEL).set(0.25)
    m.inflight.labels("default", MODEL, "r1").set(6)
    m.requests.labels("default", MODEL, "200").inc(100)
    # Another namespace's deployment of the same served name, on the same router: not counted.
    m.inflight.labels("team-b", MODEL, "b1").set(50)
    m.queue.labels("team-b", MODEL).set(9)
    m.requests.labels("team-b", MODEL, "200").inc(1000)
    source = ScrapeSource(ScrapeSourceSettings(router_url=m.url))
    try:
        first = await observe(source, target(m.url), now_s=1000.0)
        assert first.error is None
        assert (first.engine_concurrency, first.router_in_flight, first.queue_depth) == (7, 6, 0)
        assert first.kv_cache_utilization == 0.25
        assert first.arrival_rate_rps == 0.0  # no previous scrape to take a rate from
        # 30 more requests in 10 s (the clock is injected): 3 req/s. 10 first tokens at 0.3 s.
        m.requests.labels("default", MODEL, "200").inc(20)
        m.requests.labels("default", MODEL, "429").inc(10)
        m.requests.labels("team-b", MODEL, "200").inc(500)
        for _ in range(10):
            m.ttft.labels(MODEL).observe(0.3)
        m.queue.labels("default", MODEL).set(4)
        second = await observe(source, target(m.url), now_s=1010.0)
        assert second.arrival_rate_rps == pytest.approx(3.0)
        assert second.ttft_p90_s == pytest.approx(0.475)  # 0.25 + (0.5 - 0.25) x 9/10
        assert second.queue_depth == 4
        # load max(7, 6) + 4 = 11 at target 4 -> 3 replicas
        d = decide(second, initial_state(1, 0.0), AutoscalingSpec(target_concurrency_per_replica=4), 1010.0)
        assert d.desired_replicas == 3

        # The engine goes away: the observation carries the error and the policy holds.
        m.stop()
        third = await observe(source, target(m.url, ready=2), now_s=1020.0)
        assert third.error is not None and "unreachable" in third.error
        d = decide(third, initial_state(2, 0.0), AutoscalingSpec(min_replicas=0), 1020.0)
        assert (d.desired_replicas, d.reason) == (2, "metrics_stale")
    finally:
        await source.close()


async def test_counter_reset_counts_from_zero(metrics_endpoint: MetricsEndpoint) -> None:
    m = metrics_endpoint
    source = ScrapeSource(ScrapeSourceSettings(router_url=m.url))
    try:
        m.requests.labels("default", MODEL, "200").inc(50)
        await observe(source, target(m.url), now_s=0.0)
        m.requests.clear()  # the router restarted: its counter starts again
        m.requests.labels("default", MODEL, "200").inc(8)
        o = await observe(source, target(m.url), now_s=4.0)
        assert o.arrival_rate_rps == pytest.approx(2.0)
    finally:
        await source.close()


async def test_unreachable_endpoint_is_an_error_not_an_exception() -> None:
    url = f"http://127.0.0.1:{pick_free_port()}"
    source = ScrapeSource(ScrapeSourceSettings(router_url=url, timeout_s=1.0))
    try:
        o = await source.observe_engines(target(url), 5.0, [])
    finally:
        await source.close()
    assert o.error is not None and "/metrics unreachable" in o.error


def test_histogram_quantile_matches_prometheus() -> None:
    # 100 observations: 50 <= 0.1, 40 in (0.1, 0.5], 10 in (0.5, +Inf).
    buckets = {0.1: 50.0, 0.5: 90.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert histogram_quantile(0.95, buckets) == 0.5  # in +Inf: the highest finite bound
    assert histogram_quantile(0.9, {0.1: 0.0, float("inf"): 0.0}) is None
