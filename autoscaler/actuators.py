"""Actuators: where a decision goes: the InferenceDeployment's status in Kubernetes.

Local mode's actuator, which starts and drains engine processes, is ``kvfleet.local.control``'s.

The autoscaler never writes ``spec``: Argo CD and kubectl own it, and a controller writing it
would show as drift. The operator reads ``status.desiredReplicas`` and scales the engines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from kvfleet.autoscaler.settings import FIELD_MANAGER
from kvfleet.autoscaler.sources import Target
from kvfleet.kube import KubeClient, KubeError, KubeNotFound
from kvfleet.kube.ref import INFERENCE_DEPLOYMENTS
from kvfleet.status import InferenceDeploymentStatus, status_patch, status_time

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 1024  # status.scaleReason's bound in the CRD


@dataclass(frozen=True)
class ScaleCommand:
    """What the actuator writes: the count, why, and when the count last changed."""

    desired_replicas: int
    reason: str
    """``<reason code>: <detail>``, cut to the CRD's bound."""
    last_scale_time: datetime


class ActuatorError(Exception):
    """The decision could not be applied now; the loop retries on a later tick."""


class TargetGone(ActuatorError):
    """The deployment no longer exists; the loop forgets it."""


class Actuator(Protocol):
    async def apply(self, target: Target, command: ScaleCommand) -> None: ...


def scale_status(command: ScaleCommand) -> dict[str, Any]:
    """The status keys the autoscaler owns (desiredReplicas, scaleReason, lastScaleTime), built
    through the status model; the operator's keys are not in it, so the merge patch leaves them."""
    status = InferenceDeploymentStatus(
        desired_replicas=command.desired_replicas,
        scale_reason=command.reason[:MAX_REASON_CHARS],
        last_scale_time=status_time(command.last_scale_time),
    )
    return status_patch(status)


class KubernetesActuator:
    """Merge-patches ``status`` of the InferenceDeployment through the status subresource."""

    def __init__(self, api: KubeClient) -> None:
        self.api = api

    async def apply(self, target: Target, command: ScaleCommand) -> None:
        try:
            await self.api.patch_status(
                INFERENCE_DEPLOYMENTS, target.namespace, target.name, scale_status(command), field_manager=FIELD_MANAGER
            )
        except KubeNotFound as e:
            raise TargetGone(f"{target.key} no longer exists") from e
        except KubeError as e:
            raise ActuatorError(f"patching {target.key} status failed: {e}") from e
