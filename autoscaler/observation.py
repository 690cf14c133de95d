"""What the autoscaler observed about one deployment at one instant, errors included.

A metric source fills an ``Observation``; the policy reads it. ``None`` means "no series": the
policy decides whether that is normal (no engine metrics while at zero replicas) or a reason to
hold (no router metrics, no engine metrics while replicas are ready).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Observation:
    """Signals of one deployment. Sums are over its replicas; utilizations are means in [0, 1]."""

    sampled_at_s: float
    """Unix time the newest sample was taken (Prometheus' sample time, or the scrape time)."""
    ready_replicas: int = 0
    engine_concurrency: float | None = None
    """Requests running + waiting in the engines (vllm:num_requests_running + _waiting), summed."""
    router_in_flight: float | None = None
    """Requests the router has forwarded to engines and not finished."""
    queue_depth: float | None = None
    """Requests the router holds because no replica can take them (its activator queue)."""
    arrival_rate_rps: float | None = None
    """Requests arriving at the router per second."""
    kv_cache_utilization: float | None = None
    gpu_utilization: float | None = None
    """DCGM_FI_DEV_GPU_UTIL / 100, mean over the deployment's GPUs, when DCGM runs."""
    ttft_p90_s: float | None = None
    measured_cold_start_s: float | None = None
    """The launcher's last measured cold start, when the operator reported one."""
    wake_requested: bool = False
    """The router asked for a replica (requests are waiting and none is ready)."""
    error: str | None = None
    """Why the source could not observe (Prometheus down, HTTP error); the policy holds."""

    def with_wake(self) -> Observation:
        return replace(self, wake_requested=True)

    @classmethod
    def failed(cls, at_s: float, error: str, *, ready_replicas: int = 0, wake_requested: bool = False) -> Observation:
        """An observation that carries only the reason the source failed."""
        return cls(sampled_at_s=at_s, ready_replicas=ready_replicas, error=error, wake_requested=wake_requested)
