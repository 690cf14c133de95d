"""The InferenceDeployment status: what the operator and the autoscaler report.

The operator owns everything here except the autoscaler's decision (desiredReplicas,
scaleReason, lastScaleTime). Nothing in status is ever read back as desired state by Argo CD,
which is why the autoscaler writes its decision here and never into spec.

Both writers build their status from these models and send ``status_patch(model)``: the wire
keys come from the models' aliases (a misspelt key cannot reach the API server) and the values
are validated on the way (a reason the CRD would refuse fails here, naming the field).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

ConditionType = Literal["Ready", "Progressing", "Degraded", "ScaledToZero"]
CONDITION_TYPES: tuple[ConditionType, ...] = ("Ready", "Progressing", "Degraded", "ScaledToZero")
ConditionStatus = Literal["True", "False", "Unknown"]


class StatusModel(BaseModel):
    # Status tolerates unknown keys: an older operator must not crash on a newer one's status.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(StatusModel):
    """One observation in the Kubernetes condition convention."""

    type: ConditionType = Field(description="Ready, Progressing, Degraded or ScaledToZero.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")] = (
        Field(description="CamelCase reason, machine readable.")
    )
    message: Annotated[str, StringConstraints(max_length=32_768)] = Field(
        default="", description="Human-readable explanation."
    )
    last_transition_time: datetime | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation this condition was computed from."
    )


class InferenceDeploymentStatus(StatusModel):
    """Observed state of an InferenceDeployment."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the operator last reconciled."
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Engine pods that exist, up to the desired count: a rolling update's surge pod is counted by "
        "the engine Deployment only (scale subresource).",
    )
    ready_replicas: int | None = Field(
        default=None, ge=0, description="Engine pods ready to serve, up to the desired count (as replicas)."
    )
    desired_replicas: int | None = Field(
        default=None, ge=0, description="Replica count decided by the autoscaler (or spec.replicas)."
    )
    selector: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Label selector of the engine pods (for the scale subresource and HPA)."
    )
    last_scale_time: datetime | None = Field(default=None, description="When desiredReplicas last changed.")
    scale_reason: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Why the autoscaler chose desiredReplicas."
    )
    endpoint: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="OpenAI-compatible base URL clients use (through the router)."
    )
    model_digest: Annotated[str, StringConstraints(max_length=128)] | None = Field(
        default=None,
        description=(
            "sha256 of the weight-cache manifest the newest Ready pod serves (for a local model directory, of "
            "its files' names, sizes and times), as its launcher reported it."
        ),
    )
    measured_cold_start_seconds: float | None = Field(
        default=None, ge=0, description="Cold start the launcher last measured (pull to first ready)."
    )
    conditions: list[Condition] = Field(default_factory=list, max_length=8, description="Current conditions.")

    def condition(self, type_: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


def status_time(moment: datetime) -> datetime:
    """``moment`` in UTC and whole seconds, the way status times are written (RFC 3339, ``...Z``)."""
    return moment.astimezone(UTC).replace(microsecond=0)


def status_patch(status: InferenceDeploymentStatus) -> dict[str, Any]:
    """The wire form of the fields a writer set, for a merge patch of the status subresource: only
    these keys change, so the operator's and the autoscaler's fields never overwrite each other.
    Fields left unset (or set to None) are not sent: a merge patch's null would delete the key."""
    return status.model_dump(by_alias=True, exclude_unset=True, exclude_none=True, mode="json")
