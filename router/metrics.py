"""The router's own Prometheus metrics (``kvfleet_router_*``), in a registry per router instance.

The ``model`` label is always a known served name (requests for unknown models count under
``model=""``), so a client cannot grow the label set by sending random model names.
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.inflight = Gauge(
            "kvfleet_router_inflight",
            "Requests in flight to a replica.",
            ["model", "replica"],
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

    def forget_replica(self, model: str, replica_id: str) -> None:
        self._children.pop((id(self.inflight), (model, replica_id)), None)
        with contextlib.suppress(KeyError):  # never had a sample
            self.inflight.remove(model, replica_id)

    def forget_model(self, model: str) -> None:
        for key in [k for k in self._children if k[1][:1] == (model,)]:
            del self._children[key]
        with contextlib.suppress(KeyError):
            self.queue_depth.remove(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)
