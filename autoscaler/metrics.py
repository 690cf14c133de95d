"""The autoscaler's own Prometheus metrics, in a registry per autoscaler instance.

``namespace`` and ``model`` are the deployment's namespace and served name (the labels the router
uses too), so two namespaces' deployments of one served name never share a series.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.desired_replicas = Gauge(
            "kvfleet_autoscaler_desired_replicas",
            "Replica count the autoscaler decided.",
            ["namespace", "model"],
            registry=self.registry,
        )
        self.max_replicas = Gauge(
            "kvfleet_autoscaler_max_replicas",
            "The deployment's autoscaling.maxReplicas (alerts compare the desired count with it).",
            ["namespace", "model"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "kvfleet_autoscaler_decisions",
            "Decisions by reason (steady, scale_up, scale_down, metrics_stale, ...).",
            ["namespace", "model", "reason"],
            registry=self.registry,
        )
        self.metrics_stale = Gauge(
            "kvfleet_autoscaler_metrics_stale",
            "1 while the deployment's metrics are missing or stale and its count is held.",
            ["namespace", "model"],
            registry=self.registry,
        )
        self.is_leader = Gauge(
            "kvfleet_autoscaler_is_leader",
            "1 when this autoscaler replica holds the Lease and acts.",
            registry=self.registry,
        )

    def forget(self, namespace: str, model: str) -> None:
        """Drop a deleted deployment's series (a bounded label set)."""
        for gauge in (self.desired_replicas, self.max_replicas, self.metrics_stale):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, model)

    def render(self) -> bytes:
        return generate_latest(self.registry)
