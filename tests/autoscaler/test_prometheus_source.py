"""The Prometheus source against a real Prometheus scraping a real metrics endpoint."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy import decide, initial_state
from kvfleet.autoscaler.prometheus_source import PrometheusSource
from kvfleet.autoscaler.promql import deployment_queries
from kvfleet.autoscaler.settings import PrometheusSourceSettings
from kvfleet.autoscaler.sources import Target
from kvfleet.router.metrics import RouterMetrics
from kvfleet.spec import AutoscalingSpec
from tests.autoscaler.conftest import (
    MODEL,
    MetricsEndpoint,
    PrometheusServer,
    scrape_job,
    serve_text_format,
    start_prometheus,
)
from tests.conftest import pick_free_port

pytestmark = pytest.mark.slow

TARGET = Target(namespace="default", name="chat", served_name=MODEL, ready_replicas=2)
SPEC = AutoscalingSpec(
    min_replicas=0, max_replicas=10, target_concurrency_per_replica=10, scale_to_zero_after_seconds=0
)


async def poll(
    source: PrometheusSource,
    until: Callable[[Observation], bool],
    what: str,
    timeout_s: float = 40.0,
    target: Target = TARGET,
) -> Observation:
    """Observe until ``until`` holds (the first sample arrives ~5 s after Prometheus starts)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    last: Observation | None = None
    while time.monotonic() < deadline:
        last = await source.observe(target, time.time())
        if until(last):
            return last
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last observation: {last}")


async def test_observes_and_holds_when_data_goes_stale(
    metrics_endpoint: MetricsEndpoint, prometheus: PrometheusServer
) -> None:
    m = metrics_endpoint
    m.running.labels(MODEL).set(24)
    m.waiting.labels(MODEL).set(6)
    m.running.labels("other-model").set(1000)  # another deployment's engines are not counted
    m.kv.labels(MODEL).set(0.5)
    m.queue.labels("default", MODEL).set(3)
    m.inflight.labels("default", MODEL, "r1").set(20)
    m.inflight.labels("default", MODEL, "r2").set(8)
    m.requests.labels("default", MODEL, "200").inc(0)
    m.ttft.labels(MODEL)  # series start at zero, so rate() sees the increase
    source = PrometheusSource(PrometheusSourceSettings(url=prometheus.url, timeout_s=2.0))
    try:
        o = await poll(source, lambda o: o.engine_concurrency is not None and o.queue_depth is not None, "data")
        assert o.error is None
        assert o.engine_concurrency == 30  # 24 running + 6 waiting
        assert o.router_in_flight == 28  # 20 + 8 over two replicas
        assert o.queue_depth == 3
        assert o.kv_cache_utilization == 0.5
        assert o.gpu_utilization is None  # no DCGM exporter here
        assert time.time() - o.sampled_at_s < 10  # sample time, from timestamp()
        # The policy on it: load max(30, 28) + 3 = 33 / 10 per replica -> 4.
        d = decide(o, initial_state(2, time.time()), SPEC, time.time())
        assert (d.desired_replicas, d.reason) == (4, "scale_up")

        # Arrivals and first-token times, counted after Prometheus has a first sample of each.
        for _ in range(40):
            m.requests.labels("default", MODEL, "200").inc()
        for _ in range(10):
            m.ttft.labels(MODEL).observe(0.3)
        o = await poll(source, lambda o: (o.arrival_rate_rps or 0) > 0 and o.ttft_p90_s is not None, "rates")
        assert o.arrival_rate_rps is not None and o.arrival_rate_rps > 0
        # All 10 in the (0.25, 0.5] bucket: p90 interpolates to 0.25 + 0.25 x 0.9 = 0.475.
        assert o.ttft_p90_s == pytest.approx(0.475, abs=1e-6)

        # The endpoint dies: Prometheus marks its series stale, the queries come back empty,
        # and the policy holds the count (never zero on absent data, although zero is allowed).
        state = initial_state(4, time.time() - 3600)
        state = replace(state, last_traffic_at_s=time.time() - 3600)
        m.stop()
        o = await poll(source, lambda o: o.engine_concurrency is None, "the series to go stale")
        d = decide(o, state, SPEC, time.time())
        assert (d.desired_replicas, d.reason) == (4, "metrics_stale")
        assert "no concurrency metrics while 2 replicas are ready" in d.detail

        # Prometheus itself goes away: the source reports the error, the policy holds.
        prometheus.stop()
        o = await source.observe(TARGET, time.time())
        assert o.error is not None and "prometheus unreachable" in o.error
        d = decide(o, state, SPEC, time.time())
        assert (d.desired_replicas, d.reason) == (4, "metrics_stale")
    finally:
        await source.close()


async def test_unreachable_prometheus_holds() -> None:
    # Nothing listens on this port: connection refused, at once.
    source = PrometheusSource(PrometheusSourceSettings(url=f"http://127.0.0.1:{pick_free_port()}", timeout_s=2.0))
    try:
        o = await source.observe(TARGET, 1000.0)
    finally:
        await source.close()
    assert o.error is not None and "prometheus unreachable (ConnectionError)" in o.error
    d = decide(o, replace(initial_state(3, 0.0), last_traffic_at_s=0.0), SPEC, 1000.0)
    assert (d.desired_replicas, d.reason) == (3, "metrics_stale")


def test_queries_refuse_unsafe_names() -> None:
    with pytest.raises(ValueError, match="not a valid label value"):
        deployment_queries('x"} or vector(1) #', "default", "chat")
    with pytest.raises(ValueError, match="PromQL duration"):
        deployment_queries("m", "default", "chat", rate_window="1m]) or up[")
    with pytest.raises(ValueError, match="not a valid InferenceDeployment name"):
        deployment_queries("m", "default", "chat.*|.*")
    q = deployment_queries("org/model-1.5b", "team-a", "chat")
    assert (
        q["engine_concurrency"]
        == 'sum({__name__=~"vllm:num_requests_(running|waiting)",namespace="team-a",model_name="org/model-1.5b"})'
    )
    # Every selector names the namespace with the served name: two namespaces serving one name never mix.
    assert q["queue_depth"] == 'sum(kvfleet_router_queue_depth{namespace="team-a",model="org/model-1.5b"})'
    for signal, query in q.items():
        if signal != "gpu_utilization":  # DCGM's series are selected by namespace and pod
            selectors = re.findall(r"\{([^}]*)\}", query)
            assert selectors and all('namespace="team-a",model' in sel for sel in selectors), (signal, query)
    assert q["gpu_utilization"] == 'avg(DCGM_FI_DEV_GPU_UTIL{namespace="team-a",pod=~"chat-engine-.*"}) / 100'


async def test_two_namespaces_serving_one_name_do_not_mix(tmp_path: Path) -> None:
    """team-a and team-b both serve MODEL (a name freed and claimed again, or two clusters' worth of
    history): each namespace's engines are their own scrape targets (the operator's ServiceMonitor per
    deployment, so Prometheus adds the namespace), and one real router labels its series with each
    deployment's namespace, kept by honor_labels as the chart's router ServiceMonitor sets it. Each
    deployment's queries see its own numbers only."""
    engines: dict[str, Gauge] = {}
    servers = []
    jobs = ""
    for namespace in ("team-a", "team-b"):
        registry = CollectorRegistry()
        engines[namespace] = Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry)
        Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=registry).labels(MODEL).set(0)
        port = pick_free_port()
        servers.append(serve_text_format(registry, port))
        jobs += scrape_job(f"engines-{namespace}", port, namespace, honor_labels=False)
    router = RouterMetrics()
    router.queue_depth.labels("team-a", MODEL).set(5)
    router.queue_depth.labels("team-b", MODEL).set(0)
    router.track_inflight(lambda: [("team-a", MODEL, "a-0", 7, 0), ("team-b", MODEL, "b-0", 1, 0)])
    router_port = pick_free_port()
    servers.append(serve_text_format(router.registry, router_port))
    # The router runs in the release namespace: without honor_labels that would overwrite the models'.
    jobs += scrape_job("kvfleet-router", router_port, "kvfleet", honor_labels=True)
    engines["team-a"].labels(MODEL).set(40)
    engines["team-b"].labels(MODEL).set(2)
    prometheus = start_prometheus(tmp_path, 0, jobs)
    source = PrometheusSource(PrometheusSourceSettings(url=prometheus.url, timeout_s=2.0))
    try:
        seen = {}
        for namespace in ("team-a", "team-b"):
            target = Target(namespace=namespace, name="chat", served_name=MODEL, ready_replicas=1)
            o = await poll(
                source,
                lambda o: o.engine_concurrency is not None and o.router_in_flight is not None,
                f"{namespace}'s series",
                target=target,
            )
            seen[namespace] = (o.engine_concurrency, o.router_in_flight, o.queue_depth)
        assert seen == {"team-a": (40, 7, 5), "team-b": (2, 1, 0)}
    finally:
        await source.close()
        prometheus.stop()
        for server, thread in servers:
            server.shutdown()
            thread.join(timeout=5)
