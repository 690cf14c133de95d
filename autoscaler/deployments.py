"""Which deployments to scale: InferenceDeployments with autoscaling on, from the API or from files.

Each comes with its spec and what the autoscaler needs of its status (ready replicas, the last
desired count, the measured cold start). An object that does not validate is skipped with a
log line naming it: one bad object must not stop the others from scaling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kvfleet.autoscaler.kube_api import KubeApi
from kvfleet.autoscaler.sources import Target
from kvfleet.manifests import load_deployments
from kvfleet.resource import InferenceDeployment
from kvfleet.spec import API_VERSION, KIND, PLURAL, AutoscalingSpec
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


class DeploymentSource(Protocol):
    async def list(self) -> list[Scaled]: ...


class KubernetesDeployments:
    """Lists InferenceDeployments in one namespace or all of them."""

    def __init__(self, api: KubeApi, namespace: str | None = None, max_items: int = 2000) -> None:
        self.api = api
        self.namespace = namespace
        self.max_items = max_items

    async def list(self) -> list[Scaled]:
        scope = f"/namespaces/{self.namespace}" if self.namespace else ""
        body = await self.api.get(f"/apis/{API_VERSION}{scope}/{PLURAL}?limit={self.max_items}")
        items: list[dict[str, Any]] = body.get("items") or []
        out = []
        for item in items[: self.max_items]:
            meta = item.get("metadata") or {}
            where = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
            deployment, problems = validate_object({**item, "apiVersion": API_VERSION, "kind": KIND})
            if deployment is None:
                log.warning("skipping %s: %s", where, "; ".join(str(p) for p in problems[:3]))
                continue
            scaled = scaled_from(deployment)
            if scaled is not None:
                out.append(scaled)
        return out


class StaticDeployments:
    """Local mode: deployments from manifest files, with engine URLs and status set by local mode."""

    def __init__(self, items: list[Scaled]) -> None:
        self.items = list(items)

    @classmethod
    def from_files(cls, paths: list[Path]) -> StaticDeployments:
        items = []
        for path in paths:
            result = load_deployments(path)
            for where, problems in result.problems:
                raise ValueError(f"{path}{where}: {'; '.join(str(p) for p in problems)}")
            for deployment in result.deployments:
                scaled = scaled_from(deployment)
                if scaled is not None:
                    items.append(scaled)
        return cls(items)

    async def list(self) -> list[Scaled]:
        return list(self.items)

    def observe_replicas(self, key: str, ready_replicas: int, engine_urls: tuple[str, ...]) -> None:
        """Local mode reports which engines are up (the operator's status does this in a cluster)."""
        self.items = [
            replace(s, target=replace(s.target, ready_replicas=ready_replicas, engine_urls=engine_urls))
            if s.target.key == key
            else s
            for s in self.items
        ]

    def record_desired(self, key: str, desired: int) -> None:
        """What an in-process actuator applied, as the operator's status would show it."""
        self.items = [
            replace(s, current_replicas=desired, status_desired=desired) if s.target.key == key else s
            for s in self.items
        ]
