"""The router's hand-rolled counter and histogram series expose exactly what prometheus_client's would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.registry import Collector

from kvfleet.router.metrics import TTFT_BUCKETS_S, CounterSeries, HistogramSeries, Metric, RouterMetrics


class _One(Collector):
    def __init__(self, series: CounterSeries | HistogramSeries) -> None:
        self.series = series

    def collect(self) -> list[Metric]:
        return [self.series.collect()]


def exposition(registry: CollectorRegistry) -> list[str]:
    # ``_created`` timestamps differ by construction time and the series do not export them.
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_histogram_series_matches_prometheus_client_including_values_on_bucket_edges() -> None:
    values = [0.0, 0.005, 0.0051, 0.3, 1.0, 7.5, 299.0, 300.0, 301.0, 1e9]
    reference = CollectorRegistry()
    hist = Histogram("t_seconds", "doc", ["model"], buckets=TTFT_BUCKETS_S, registry=reference)
    ours = HistogramSeries("t_seconds", "doc", ["model"], TTFT_BUCKETS_S)
    for i, v in enumerate(values):
        model = "a" if i % 3 else "b"
        hist.labels(model).observe(v)
        ours.observe((model,), v)
    registry = CollectorRegistry()
    registry.register(_One(ours))
    assert exposition(registry) == exposition(reference)
    text = "\n".join(exposition(registry))
    assert 't_seconds_bucket{le="0.005",model="a"} 1.0' in text  # 0.005 lands in le="0.005"
    assert 't_seconds_bucket{le="+Inf",model="b"} 4.0' in text


def test_counter_series_matches_prometheus_client() -> None:
    reference = CollectorRegistry()
    counter = Counter("c", "doc", ["model", "code"], registry=reference)
    ours = CounterSeries("c", "doc", ["model", "code"])
    for labels in [("m", "200"), ("m", "200"), ("", "404"), ("m", "503")]:
        counter.labels(*labels).inc()
        ours.inc(labels)
    registry = CollectorRegistry()
    registry.register(_One(ours))
    assert exposition(registry) == exposition(reference)


def test_forgetting_a_model_drops_its_series_only() -> None:
    """Two namespaces serve one name: each keeps its own series, and forgetting one leaves the other."""
    metrics = RouterMetrics()
    for model in (("gone", "m"), ("kept", "m")):
        metrics.requests.inc((*model, "200"))
        metrics.ttft.observe(model, 0.1)
        metrics.prefix_match.observe(model, 0.5)
        metrics.retries.inc(model)
    metrics.forget_model(("gone", "m"))
    text = metrics.render().decode()
    assert 'namespace="gone"' not in text
    for name in ("requests_total", "ttft_seconds_count", "prefix_match_ratio_count", "retries_total"):
        assert (
            f'kvfleet_router_{name}{{model="m",namespace="kept"}} 1.0' in text
            or f'kvfleet_router_{name}{{code="200",model="m",namespace="kept"}} 1.0' in text
        ), name
