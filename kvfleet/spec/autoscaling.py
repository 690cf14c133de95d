"""``spec.autoscaling``: the replica bounds, the per-replica targets (concurrency, KV-cache
usage, time to first token), the windows and delays, and scale to zero, with the rules that keep
them consistent (min <= max, zero only with minReplicas: 0, panic window shorter than the stable one)."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvfleet.spec.base import ApiModel, cross_field_error


class AutoscalingSpec(ApiModel):
    """Traffic- and utilization-driven autoscaling; scale to zero needs minReplicas: 0."""

    enabled: bool = Field(default=True, description="Let kvfleet's autoscaler set the replica count.")
    min_replicas: int = Field(default=1, ge=0, le=1000, description="Lower bound; 0 allows scale to zero.")
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Upper bound on replicas.")
    target_concurrency_per_replica: float = Field(
        default=16.0, gt=0, le=10_000, description="In-flight requests (running + waiting) one replica should hold."
    )
    target_kv_cache_utilization: float = Field(
        default=0.8,
        alias="targetKVCacheUtilization",
        gt=0,
        le=1.0,
        description="KV-cache usage fraction above which to add replicas.",
    )
    ttft_slo_seconds: float | None = Field(
        default=None,
        alias="ttftSLOSeconds",
        gt=0,
        le=600,
        description="Time-to-first-token p90 objective; breaching it adds replicas.",
    )
    scale_to_zero_after_seconds: float | None = Field(
        default=None,
        ge=0,
        le=604_800,
        description="Idle time before scaling to zero (needs minReplicas: 0; default 300 when it is 0).",
    )
    scale_down_delay_seconds: float = Field(
        default=120.0, ge=0, le=86_400, description="Demand must stay lower this long before replicas are removed."
    )
    window_seconds: float = Field(default=60.0, ge=1, le=3600, description="Stable window the load is averaged over.")
    panic_window_seconds: float = Field(
        default=6.0, ge=1, le=600, description="Short window that reacts to bursts (must be < windowSeconds)."
    )
    cold_start_seconds: float = Field(
        default=60.0,
        ge=0,
        le=7200,
        description="Estimated time from scale-up to a ready replica; the operator may learn a better one.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise cross_field_error(
                "minReplicas",
                f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})",
            )
        if self.scale_to_zero_after_seconds is not None and self.min_replicas != 0:
            raise cross_field_error(
                "scaleToZeroAfterSeconds",
                f"scale to zero needs minReplicas: 0 (it is {self.min_replicas})",
            )
        if self.panic_window_seconds >= self.window_seconds:
            raise cross_field_error(
                "panicWindowSeconds",
                f"panicWindowSeconds ({self.panic_window_seconds:g}) must be < windowSeconds ({self.window_seconds:g})",
            )
        return self

    @property
    def effective_scale_to_zero_after_s(self) -> float | None:
        """Idle seconds before zero, or None when the deployment never scales to zero."""
        if self.min_replicas != 0:
            return None
        return 300.0 if self.scale_to_zero_after_seconds is None else self.scale_to_zero_after_seconds
