"""The autoscaler's settings: one typed, validated object (units in the names, bounds on all)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.autoscaler.policy import PolicySettings

POLICY_FIELDS = frozenset(
    {
        "max_metrics_age_s",
        "panic_threshold_ratio",
        "scale_down_max_fraction",
        "scale_down_step_interval_s",
        "target_gpu_utilization",
    }
)
"""Policy knobs ``AutoscalerSettings`` once held at its top level; still accepted there."""

FIELD_MANAGER = "kvfleet-autoscaler"
"""The field manager of every write the autoscaler makes (its Lease, status.desiredReplicas)."""


class AutoscalerSettings(BaseModel):
    """What ``kvfleet autoscaler run`` needs. Per-deployment knobs live in the spec, not here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["kubernetes"] = Field(
        default="kubernetes",
        description="kubernetes: watch InferenceDeployments, read Prometheus, patch status. Local mode is "
        "`kvfleet local up` (this control loop with a process actuator), not a mode of this command.",
    )
    namespace: str | None = Field(default=None, max_length=63, description="Only this namespace; None: all.")
    prometheus_url: str | None = Field(
        default=None, pattern=r"^https?://[^\s]+$", description="Prometheus HTTP API (kubernetes mode)."
    )
    prometheus_timeout_s: float = Field(default=5.0, gt=0, le=60)
    rate_window: str = Field(default="1m", pattern=r"^[0-9]+(s|m)$", description="rate() window for PromQL.")
    tick_interval_s: float = Field(
        default=2.0, ge=0.1, le=60, description="Time between decisions (a wake-up decides at once)."
    )
    max_concurrent_observations: int = Field(default=16, ge=1, le=256, description="Sources queried in parallel.")
    max_deployments: int = Field(default=2000, ge=1, le=100_000, description="Deployments handled per tick.")
    reason_refresh_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="A changed reason alone (same count) is written at most this often, sparing the API server.",
    )
    listen_host: str = Field(default="0.0.0.0", description="Address of the wake / metrics / health endpoint.")
    listen_port: int = Field(default=8080, ge=0, le=65535, description="Its port (0 picks a free one).")
    wake_token_file: Path | None = Field(
        default=None,
        description="File holding the token a POST /v1/wake must carry (the routers send it); unset: no check.",
    )
    kubeconfig: str | None = Field(default=None, description="kubeconfig file; default: in-cluster, then $KUBECONFIG.")
    context: str | None = Field(default=None, description="kubeconfig context.")
    leader_election: bool = Field(default=True, description="Act only while holding the Lease.")
    lease_name: str = Field(default="kvfleet-autoscaler", max_length=253)
    lease_namespace: str = Field(
        default="default", max_length=63, description="The Lease's namespace ($POD_NAMESPACE)."
    )
    identity: str = Field(default="", max_length=253, description="This replica's Lease identity ($POD_NAME).")
    lease_duration_s: float = Field(default=15.0, gt=0, le=3600)
    renew_deadline_s: float = Field(default=10.0, gt=0, le=3600)
    retry_period_s: float = Field(default=2.0, gt=0, le=3600)
    policy: PolicySettings = Field(
        default_factory=PolicySettings,
        description="The scaling policy's knobs shared by every deployment (bounds and defaults in PolicySettings).",
    )

    @model_validator(mode="before")
    @classmethod
    def _nest_policy_fields(cls, data: Any) -> Any:
        """Policy knobs given at the top level (their names before ``policy`` nested them) go into it."""
        if not isinstance(data, dict) or not POLICY_FIELDS & data.keys():
            return data
        flat = {k: data[k] for k in POLICY_FIELDS & data.keys()}
        nested = data.get("policy", {})
        if isinstance(nested, PolicySettings):
            nested = asdict(nested)
        if not isinstance(nested, dict):
            return data  # the field's own validation names the problem
        return {**{k: v for k, v in data.items() if k not in flat}, "policy": {**nested, **flat}}

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalerSettings:
        if self.prometheus_url is None:
            raise ValueError("prometheus_url is required in kubernetes mode")
        if self.leader_election and not self.identity:
            raise ValueError("identity is required with leader election (set POD_NAME or --identity)")
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("need retry_period_s < renew_deadline_s < lease_duration_s")
        return self
