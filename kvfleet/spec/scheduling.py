"""``spec.scheduling``: where engine pods may run (node selector, tolerations, affinity, priority
class) and how replicas spread over nodes or zones."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from kvfleet.spec.base import ApiModel

LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class Toleration(ApiModel):
    key: Annotated[str, StringConstraints(max_length=316)] | None = Field(default=None, description="Taint key.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: Annotated[str, StringConstraints(max_length=63)] | None = Field(default=None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty tolerates all."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="For NoExecute: how long to stay.")


class TopologySpreadSpec(ApiModel):
    """Spread replicas over a topology domain (nodes by default)."""

    max_skew: int = Field(default=1, ge=1, le=100, description="Largest allowed difference between domains.")
    topology_key: Annotated[str, StringConstraints(max_length=316)] = Field(
        default="kubernetes.io/hostname", description="Node label that defines a domain."
    )
    when_unsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = Field(
        default="ScheduleAnyway", description="Whether the spread is a preference or a rule."
    )


class SchedulingSpec(ApiModel):
    """Where engine pods may run."""

    node_selector: dict[
        Annotated[str, StringConstraints(pattern=LABEL_KEY_PATTERN, max_length=316)],
        Annotated[str, StringConstraints(max_length=63)],
    ] = Field(default_factory=dict, max_length=64, description="Node labels the pods require (at most 64).")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Taints tolerated.")
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Kubernetes Affinity, passed to the pod spec verbatim (the API server validates it there).",
    )
    priority_class_name: Annotated[str, StringConstraints(max_length=253)] | None = Field(
        default=None, description="PriorityClass of the engine pods."
    )
    topology_spread: TopologySpreadSpec | None = Field(
        default_factory=TopologySpreadSpec, description="Spread of replicas across nodes or zones."
    )
