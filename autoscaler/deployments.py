"""Which deployments to scale: InferenceDeployments with autoscaling on, watched in the API.

Each comes with its spec and what the autoscaler needs of its status (ready replicas, the last
desired count, the measured cold start). An object that does not validate is skipped with a
log line naming it: one bad object must not stop the others from scaling.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvfleet.autoscaler.sources import Target
from kvfleet.kube import KubeClient
from kvfleet.kube.ref import INFERENCE_DEPLOYMENTS
from kvfleet.kube.watch import ObjectKey, ResourceWatch, WatchSettings
from kvfleet.resource import InferenceDeployment
from kvfleet.spec import API_VERSION, KIND, AutoscalingSpec
from kvfleet.validation import validate_object

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scaled:
    """One deployment to decide for."""

    target: Target
    spec: AutoscalingSpec
    current_replicas: int
    """The count in force: status.desiredReplicas, else status.replicas, else minReplicas."""
    status_desired: int | None = None
    """status.desiredReplicas as read (None when never written)."""


def scaled_from(deployment: InferenceDeployment, engine_urls: tuple[str, ...] = ()) -> Scaled | None:
    spec = deployment.spec.autoscaling
    if spec is None or not spec.enabled:
        return None
    status = deployment.status
    ready = (status.ready_replicas if status else None) or 0
    current = None
    if status is not None:
        current = status.desired_replicas if status.desired_replicas is not None else status.replicas
    target = Target(
        namespace=deployment.namespace,
        name=deployment.name,
        served_name=deployment.served_name,
        ready_replicas=ready,
        measured_cold_start_s=status.measured_cold_start_seconds if status else None,
        engine_urls=engine_urls,
    )
    status_desired = status.desired_replicas if status is not None else None
    return Scaled(target, spec, spec.min_replicas if current is None else current, status_desired)


class DeploymentsUnavailable(Exception):
    """The deployments cannot be listed now; the loop skips this tick and tries on the next."""


class DeploymentSource(Protocol):
    async def list(self) -> list[Scaled]:
        """The deployments to decide for; raises ``DeploymentsUnavailable`` when it cannot say."""
        ...


class KubernetesDeployments:
    """The autoscaled InferenceDeployments in one namespace or all, kept current by a watch: one LIST
    at start, then only changes (each changed object validated once). ``list`` reads memory, so a
    tick costs the API server nothing."""

    def __init__(self, api: KubeClient, namespace: str | None = None, settings: WatchSettings | None = None) -> None:
        path = INFERENCE_DEPLOYMENTS.collection(namespace)
        self.watch = ResourceWatch(api, path, self._changed, settings=settings)
        self._scaled: dict[ObjectKey, Scaled] = {}
        self.validations = 0
        """Objects validated so far: one per change seen (tests and logs read it)."""

    def _changed(self, key: ObjectKey, obj: Mapping[str, Any] | None) -> None:
        self._scaled.pop(key, None)
        if obj is None:
            return
        self.validations += 1
        deployment, problems = validate_object({**obj, "apiVersion": API_VERSION, "kind": KIND})
        if deployment is None:
            log.warning("skipping %s/%s: %s", *key, "; ".join(str(p) for p in problems[:3]))
            return
        scaled = scaled_from(deployment)
        if scaled is not None:
            self._scaled[key] = scaled

    async def run(self) -> None:
        """Keep watching until cancelled (the first LIST, and any relist, retried with back-off)."""
        await self.watch.run()

    async def list(self) -> list[Scaled]:
        # Before the first LIST there is nothing to decide on; afterwards the last state known is
        # used while a watch is re-established, as a client-go informer's cache is.
        if not self.watch.listed:
            raise DeploymentsUnavailable(f"{self.watch.path}: not listed yet")
        return [self._scaled[key] for key in sorted(self._scaled)]
