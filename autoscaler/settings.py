"""The autoscaler's settings: one typed, validated object (units in the names, bounds on all).

Each part's knobs are defined once, where their bounds are: the control loop's
(``ControllerSettings``), the Prometheus source's, the Lease's and the policy's. ``AutoscalerSettings``
nests them; the command line's flat names (``--tick-interval-s``, ``--identity``...) are accepted at
the top level and go into their part, so the flags and the chart's args stay as they are.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.autoscaler.policy import PolicySettings
from kvfleet.autoscaler.promql import MetricNames

FIELD_MANAGER = "kvfleet-autoscaler"
"""The field manager of every write the autoscaler makes (its Lease, status.desiredReplicas)."""

TICK_INTERVAL_BOUNDS_S = (0.05, 60.0)
"""Time between decisions, for the cluster's autoscaler and local mode alike: below 50 ms a tick's
own scrapes and queries would not finish; above a minute a burst waits too long for capacity."""


@dataclass(frozen=True)
class ControllerSettings:
    """The control loop's pace and bounds."""

    tick_interval_s: float = 2.0
    """Time between decisions (a wake-up decides at once)."""
    max_concurrent_observations: int = 16
    """Sources queried in parallel."""
    reason_refresh_s: float = 30.0
    """A changed reason alone (same count) is written at most this often, sparing the API server."""
    max_deployments: int = 2000
    """Deployments handled per tick."""

    def __post_init__(self) -> None:
        low, high = TICK_INTERVAL_BOUNDS_S
        if not low <= self.tick_interval_s <= high:
            raise ValueError(f"tick_interval_s must be in [{low}, {high}], got {self.tick_interval_s}")
        if not 1 <= self.max_concurrent_observations <= 256:
            raise ValueError(f"max_concurrent_observations must be in [1, 256], got {self.max_concurrent_observations}")
        if not 0 <= self.reason_refresh_s <= 3600:
            raise ValueError(f"reason_refresh_s must be in [0, 3600], got {self.reason_refresh_s}")
        if not 1 <= self.max_deployments <= 100_000:
            raise ValueError(f"max_deployments must be in [1, 100000], got {self.max_deployments}")


@dataclass(frozen=True)
class PrometheusSourceSettings:
    url: str
    timeout_s: float = 5.0
    """Per-query HTTP timeout; a tick's queries run one after another in a thread."""
    rate_window: str = "1m"
    """Range of rate() for arrivals and TTFT: at least 4 scrape intervals (15 s scrapes -> 1m)."""
    names: MetricNames = field(default_factory=MetricNames)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"https?://\S+", self.url):
            raise ValueError(f"prometheus url must be http(s)://..., got {self.url!r}")
        if not 0 < self.timeout_s <= 60:
            raise ValueError(f"timeout_s must be in (0, 60], got {self.timeout_s}")
        if not re.fullmatch(r"[0-9]+(s|m)", self.rate_window):
            raise ValueError(f"rate_window must be a PromQL duration in s or m (like 1m), got {self.rate_window!r}")


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str = "default"
    """The Lease's namespace (the chart passes $POD_NAMESPACE)."""
    name: str = "kvfleet-autoscaler"
    identity: str = ""
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("identity is required with leader election (set POD_NAME or --identity)")
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s <= 3600:
            raise ValueError(
                "need 0 < retry_period_s < renew_deadline_s < lease_duration_s <= 3600, got "
                f"{self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )


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

FLAT_FIELDS: dict[str, dict[str, str]] = {
    "loop": {k: k for k in ("tick_interval_s", "max_concurrent_observations", "reason_refresh_s", "max_deployments")},
    "prometheus": {"prometheus_url": "url", "prometheus_timeout_s": "timeout_s", "rate_window": "rate_window"},
    "lease": {
        "lease_namespace": "namespace",
        "lease_name": "name",
        "identity": "identity",
        "lease_duration_s": "lease_duration_s",
        "renew_deadline_s": "renew_deadline_s",
        "retry_period_s": "retry_period_s",
    },
    "policy": {k: k for k in POLICY_FIELDS},
}
"""The command line's flat names, by the part they belong to: {part: {flat name: the part's name}}."""


class AutoscalerSettings(BaseModel):
    """What ``kvfleet autoscaler run`` needs. Per-deployment knobs live in the spec, not here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["kubernetes"] = Field(
        default="kubernetes",
        description="kubernetes: watch InferenceDeployments, read Prometheus, patch status. Local mode is "
        "`kvfleet local up` (this control loop with a process actuator), not a mode of this command.",
    )
    namespace: str | None = Field(default=None, max_length=63, description="Only this namespace; None: all.")
    prometheus: PrometheusSourceSettings | None = Field(
        default=None, description="Where the observations come from (its HTTP API); required."
    )
    loop: ControllerSettings = Field(default_factory=ControllerSettings, description="The control loop's pace.")
    listen_host: str = Field(default="0.0.0.0", description="Address of the wake / metrics / health endpoint.")
    listen_port: int = Field(default=8080, ge=0, le=65535, description="Its port (0 picks a free one).")
    wake_token_file: Path | None = Field(
        default=None,
        description="File holding the token a POST /v1/wake must carry (the routers send it); unset: no check.",
    )
    kubeconfig: str | None = Field(default=None, description="kubeconfig file; default: in-cluster, then $KUBECONFIG.")
    context: str | None = Field(default=None, description="kubeconfig context.")
    leader_election: bool = Field(default=True, description="Act only while holding the Lease.")
    lease: LeaseSettings | None = Field(
        default=None, description="The Lease this replica holds while it acts (leader election only)."
    )
    policy: PolicySettings = Field(
        default_factory=PolicySettings,
        description="The scaling policy's knobs shared by every deployment (bounds and defaults in PolicySettings).",
    )

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_fields(cls, data: Any) -> Any:
        """Flat names (the command line's) go into their part; a part given whole is kept and the flat
        names override its fields. Without leader election there is no Lease."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for part, names in FLAT_FIELDS.items():
            flat = {names[k]: data.pop(k) for k in names.keys() & data.keys()}
            nested = data.get(part)
            if nested is not None and not isinstance(nested, dict):
                nested = asdict(nested)  # a settings object given whole
            if part == "lease" and not data.get("leader_election", True):
                data.pop("lease", None)
                continue
            if flat or part == "lease":  # a Lease always, with leader election: its identity is required
                data[part] = {**(nested or {}), **flat}
        return data

    @model_validator(mode="after")
    def _prometheus_given(self) -> AutoscalerSettings:
        # After the fields, so a bad flag is named first; the loop has nothing to decide from without it.
        if self.prometheus is None:
            raise ValueError("prometheus_url is required (--prometheus-url): the autoscaler decides from Prometheus")
        return self
