"""The policy's knobs shared by every deployment (per-deployment ones live in the spec's autoscaling).

``AutoscalerSettings.policy`` nests this object: the bounds are here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.autoscaler.forecast import HoltSettings, SeasonalSettings
from kvfleet.autoscaler.service_time import ServiceTimeSettings


@dataclass(frozen=True)
class PolicySettings:
    """Knobs shared by every deployment, each with its unit and why the default."""

    panic_threshold_ratio: float = 2.0
    """Knative's default: panic when the 6 s proposal is 200% of the current count."""
    max_metrics_age_s: float = 30.0
    """Older samples are stale (two Prometheus scrapes at the usual 15 s interval)."""
    scale_down_max_fraction: float = 0.25
    """Remove at most this share of replicas per step (>= 1 always). A replica's concurrency grows
    faster than its arrival rate near saturation, so a big cut looks safe and is not: small steps,
    each observed before the next."""
    scale_down_step_interval_s: float = 30.0
    """Least time between two scale-down steps, so each step's effect is seen before the next."""
    target_gpu_utilization: float | None = None
    """Off by default: DCGM_FI_DEV_GPU_UTIL is the share of time any kernel ran, so it reads ~100%
    as soon as one request is in flight and would add a replica on every tick. Set a target only
    for a GPU metric that tracks load (e.g. SM activity)."""
    ttft_max_scale_factor: float = 2.0
    """A TTFT breach at most doubles the replicas in one decision."""
    forecast: HoltSettings = field(default_factory=HoltSettings)
    latency_alpha: float = 0.2
    """Smoothing of the Little's-law latency estimate used to turn a forecast rate into concurrency."""
    service_time: ServiceTimeSettings = field(default_factory=ServiceTimeSettings)
    seasonal: SeasonalSettings = field(default_factory=SeasonalSettings)
    max_forecast_growth_ratio: float = 4.0
    """A forecast adds at most (ratio - 1) x the stable load (or one replica's target) to it."""
    max_history_samples: int = 4096
    """Bound on the samples and proposals kept in state (a 1 s tick over a 1 h window)."""

    def __post_init__(self) -> None:
        checks = {
            "panic_threshold_ratio": 1.0 < self.panic_threshold_ratio <= 100,
            "max_metrics_age_s": 0 < self.max_metrics_age_s <= 3600,
            "scale_down_max_fraction": 0.0 < self.scale_down_max_fraction <= 1.0,
            "scale_down_step_interval_s": 0 <= self.scale_down_step_interval_s <= 3600,
            "target_gpu_utilization": self.target_gpu_utilization is None or 0 < self.target_gpu_utilization <= 1,
            "ttft_max_scale_factor": 1.0 < self.ttft_max_scale_factor <= 100,
            "latency_alpha": 0.0 < self.latency_alpha <= 1.0,
            "max_forecast_growth_ratio": 1.0 <= self.max_forecast_growth_ratio <= 100,
            "max_history_samples": 1 <= self.max_history_samples <= 1_000_000,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid policy settings: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


DEFAULT_POLICY = PolicySettings()
