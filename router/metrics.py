"""The router's own Prometheus metrics (``kvfleet_router_*``), in a registry per router instance.

The ``model`` label is always a known served name (requests for unknown models count under
``model=""``), so a client cannot grow the label set by sending random model names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        # Labelled children by (metric, labels): ``labels()`` costs a lock and a tuple build per call, and the
        # hot path asks for the same few children on every request. Bounded like the label sets themselves.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "kvfleet_router_requests",
            "Requests answered, by served model and HTTP status code.",
            ["model", "code"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "kvfleet_router_queue_depth",
            "Requests held while the model has no ready replica.",
            ["model"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvfleet_router_ttft_seconds",
            "Time from receiving a request to forwarding the first response byte.",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.prefix_match = Histogram(
            "kvfleet_router_prefix_match_ratio",
            "Fraction of the prompt's blocks the picked replica was believed to hold.",
            ["model"],
            buckets=RATIO_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "kvfleet_router_retries",
            "Attempts retried on another replica after failing before the first byte.",
            ["model"],
            registry=self.registry,
        )

    def child(self, metric: _Metric, *labels: str) -> _Metric:
        """``metric.labels(*labels)``, cached."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def track_inflight(self, inflight: Callable[[], Iterable[tuple[str, str, int, int]]]) -> None:
        """Export ``kvfleet_router_inflight{model,replica}`` and ``kvfleet_router_awaiting_first_byte{model,replica}``
        from ``inflight()``'s (model, replica, in flight, awaiting first byte) at scrape time.

        Read when scraped rather than set on every request: two gauge updates per request were ~3 us of
        the router's CPU per request, and a replica that leaves simply stops being reported.
        """
        self.registry.register(_InflightCollector(inflight))

    def forget_model(self, model: str) -> None:
        for key in [k for k in self._children if k[1][:1] == (model,)]:
            del self._children[key]
        with contextlib.suppress(KeyError):
            self.queue_depth.remove(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _InflightCollector(Collector):
    def __init__(self, inflight: Callable[[], Iterable[tuple[str, str, int, int]]]) -> None:
        self._inflight = inflight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvfleet_router_inflight", "Requests in flight to a replica.", labels=["model", "replica"]
        )
        waiting = GaugeMetricFamily(
            "kvfleet_router_awaiting_first_byte",
            "Requests sent to a replica that have had no response body byte yet (queued or prefilling).",
            labels=["model", "replica"],
        )
        for model, replica_id, count, awaiting in self._inflight():
            family.add_metric([model, replica_id], count)
            waiting.add_metric([model, replica_id], awaiting)
        yield family
        yield waiting
