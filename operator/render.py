"""Pure renderers: an InferenceDeployment (+ the replica count) in, its child objects out.

The operator applies exactly these dicts with server-side apply, and ``kvfleet plan`` prints them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvfleet.spec import API_VERSION, KIND, InferenceDeploymentSpec

from . import names
from .pin import Pin, decide_pin
from .pod import engine_ports, render_pod_template, startup_budget_s
from .settings import OperatorSettings

# Deployment rollouts wait for the whole startup budget before Kubernetes calls them stuck.
PROGRESS_DEADLINE_SLACK_S = 120


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment children belong to; uid is None when rendering from a manifest."""

    name: str
    namespace: str
    uid: str | None = None


@dataclass(frozen=True)
class ChildKind:
    """What the API client needs to address a child: apiVersion, kind and the URL plural."""

    api_version: str
    kind: str
    plural: str


DEPLOYMENT = ChildKind("apps/v1", "Deployment", "deployments")
SERVICE = ChildKind("v1", "Service", "services")
CONFIGMAP = ChildKind("v1", "ConfigMap", "configmaps")
PDB = ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
SERVICE_MONITOR = ChildKind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
CHILD_KINDS = (CONFIGMAP, SERVICE, DEPLOYMENT, PDB, SERVICE_MONITOR)
BEFORE_PODS = (CONFIGMAP, SERVICE)
"""Applied (and accepted) before the Deployment: its pods mount the ConfigMaps."""
T = TypeVar("T")


def kind_of(obj: dict[str, Any]) -> ChildKind:
    for kind in CHILD_KINDS:
        if kind.api_version == obj["apiVersion"] and kind.kind == obj["kind"]:
            return kind
    raise ValueError(f"not a child kind: {obj['apiVersion']} {obj['kind']}")


def _metadata(owner: Owner, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace, "labels": names.labels(owner.name)}
    if owner.uid is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def spec_json(owner: Owner, spec: InferenceDeploymentSpec) -> str:
    """The launcher's input (docs/contracts.md): the spec with defaults filled, camelCase."""
    doc = {
        "name": owner.name,
        "namespace": owner.namespace,
        "servedName": spec.served_name(owner.name),
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def render_configmap(owner: Owner, spec: InferenceDeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    data = {names.SPEC_FILE: spec_json(owner, spec)}
    if spec.cache.artifacts.enabled and settings.artifact_public_keys is not None:
        # Public keys only, in a ConfigMap: a key rotation reaches the next launch without rolling pods.
        data[names.ARTIFACT_KEYS_FILE] = settings.artifact_public_keys
    return {
        "apiVersion": CONFIGMAP.api_version,
        "kind": CONFIGMAP.kind,
        "metadata": _metadata(owner, names.spec_configmap_name(owner.name)),
        "data": data,
    }


def render_pin_configmap(owner: Owner, pin: Pin) -> dict[str, Any]:
    """The pinned model digest the launchers read (operator/pin.py); empty until one is pinned."""
    return {
        "apiVersion": CONFIGMAP.api_version,
        "kind": CONFIGMAP.kind,
        "metadata": _metadata(owner, names.pin_configmap_name(owner.name)),
        "data": {names.PIN_KEY: pin.digest or "", names.PIN_MODEL_KEY: pin.model},
    }


def render_deployment(
    owner: Owner, spec: InferenceDeploymentSpec, replicas: int, settings: OperatorSettings
) -> dict[str, Any]:
    return {
        "apiVersion": DEPLOYMENT.api_version,
        "kind": DEPLOYMENT.kind,
        "metadata": _metadata(owner, names.engine_name(owner.name)),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": names.selector(owner.name)},
            # Surge, never drop: a single-replica deployment keeps serving through a rollout. Without
            # a spare GPU the surge pod stays Pending and the rollout reports Degraded.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": startup_budget_s(spec, settings) + PROGRESS_DEADLINE_SLACK_S,
            "revisionHistoryLimit": 3,
            "template": render_pod_template(owner.name, owner.namespace, spec, settings),
        },
    }


def render_service(owner: Owner, spec: InferenceDeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": SERVICE.api_version,
        "kind": SERVICE.kind,
        "metadata": _metadata(owner, names.engine_name(owner.name)),
        "spec": {
            # Headless: the router picks replicas itself from the EndpointSlices, so a virtual IP
            # and kube-proxy balancing would only get in its way.
            "clusterIP": "None",
            "selector": names.selector(owner.name),
            # Its EndpointSlices carry these names: the routers read http and kv-events there.
            "ports": engine_ports(spec, settings, "port"),
        },
    }


def render_pdb(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": PDB.api_version,
        "kind": PDB.kind,
        "metadata": _metadata(owner, names.pdb_name(owner.name)),
        "spec": {
            # maxUnavailable, not minAvailable: a one-replica deployment must not block node drains.
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.selector(owner.name)},
        },
    }


def render_service_monitor(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": SERVICE_MONITOR.api_version,
        "kind": SERVICE_MONITOR.kind,
        "metadata": _metadata(owner, names.engine_name(owner.name)),
        "spec": {
            "selector": {"matchLabels": names.selector(owner.name)},
            "endpoints": [
                {"port": names.HTTP_PORT, "path": "/metrics", "interval": "15s"},
                {"port": names.LAUNCHER_PORT, "path": "/metrics", "interval": "30s"},
            ],
        },
    }


def apply_waves(items: list[T], kind: Callable[[T], ChildKind]) -> list[list[T]]:
    """``items`` (in render order) in the waves a reconcile applies them: each wave's children at once,
    the waves one after another. First what the pods use (the ConfigMaps they mount, the Service whose
    endpoints they join), so a refused one stops the Deployment as before; then the Deployment with
    the rest (PodDisruptionBudget, ServiceMonitor), which nothing waits on. Two round trips for a new
    deployment where one per child took six (a reconcile's requests are its latency: every reconcile
    slot waits on them, docs/benchmarks/scale.md)."""
    first = [item for item in items if kind(item) in BEFORE_PODS]
    rest = [item for item in items if kind(item) not in BEFORE_PODS]
    return [wave for wave in (first, rest) if wave]


def render_children(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    replicas: int,
    settings: OperatorSettings,
    *,
    service_monitor: bool,
    pin: Pin | None = None,
) -> list[dict[str, Any]]:
    """Every child, the ConfigMaps first (``apply_waves`` applies them before the pods that mount
    them). Without ``pin`` (``kvfleet plan``), the pin ConfigMap is rendered empty, as on a
    deployment's first apply."""
    if pin is None:
        pin = decide_pin(spec, None, None).pin
    children = [
        render_configmap(owner, spec, settings),
        render_pin_configmap(owner, pin),
        render_service(owner, spec, settings),
        render_deployment(owner, spec, replicas, settings),
        render_pdb(owner),
    ]
    if service_monitor:
        children.append(render_service_monitor(owner))
    return children
