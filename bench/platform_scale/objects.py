"""What a scale run creates and how it tells that it is done: manifests, readiness, percentiles."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvfleet.kube import Ref
from kvfleet.operator.render import Owner, render_deployment
from kvfleet.operator.settings import OperatorSettings
from kvfleet.spec import InferenceDeploymentSpec
from kvfleet_testkit.manifests import SCALE_POLICY, inference_deployment

REPLICAS = 3  # engine pods per deployment: 1,000 deployments make 3,000 pods
GPUS_PER_NODE = 16
BIG_PRODUCT = "NVIDIA-H100-80GB-HBM3"  # the main pool (ClusterSettings' default product)
SMALL_PRODUCT = "NVIDIA-L4"  # the pool of 300 GPUs the oversized deployment asks 500 replicas of
SMALL_POOL = (30, 10)  # nodes x GPUs
DOOMED = 50  # deployments in the namespace that is deleted
POLICY = SCALE_POLICY
BAD_REASONS = ("InvalidSpec", "PolicyViolation")
INFD = Ref("kvfleet.io/v1alpha1", "inferencedeployments")
DEPLOYMENTS = Ref("apps/v1", "deployments")
PODS = Ref("v1", "pods")
EVENTS = Ref("v1", "events")
NAMESPACES = Ref("v1", "namespaces")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 2)


def summary(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50_s": pct(values, 0.5), "p99_s": pct(values, 0.99), "max_s": pct(values, 1.0)}


def namespace_of(i: int, n: int) -> str:
    return f"team-{i % min(50, n):02d}"


def infd(name: str, ns: str, *, replicas: int = REPLICAS, invalid: bool = False, product: str | None = None) -> dict:
    """One of the run's InferenceDeployments (the builder tests/k8s/test_scale_real.py uses too);
    ``invalid``: refused by the operator's spec policy (POLICY), so Degraded=PolicyViolation."""
    return inference_deployment(name, ns, replicas=replicas, gpu_product=product or BIG_PRODUCT, invalid=invalid)


def engine_spec(name: str, ns: str) -> InferenceDeploymentSpec:
    """The spec of ``infd(name, ns)``, as the operator reads it."""
    return InferenceDeploymentSpec.model_validate(infd(name, ns)["spec"])


def engine_deployment(name: str, ns: str) -> dict[str, Any]:
    """The engine Deployment the operator renders for ``infd(name, ns)`` (no owner)."""
    return render_deployment(Owner(name, ns), engine_spec(name, ns), REPLICAS, OperatorSettings())


FLOOR_PODS = ("engine", "minimal")
"""What the floor's pods are: ``engine``, the pods kvfleet's engine Deployment runs (the floor the
goals are read against); ``minimal``, one container with only its GPU limit (the floor before,
kept to show what the engine pod's own size costs the control plane)."""


def plain_deployment(name: str, ns: str, pods: str = "engine") -> dict:
    """The floor: a Deployment of the same pods, with nothing of kvfleet. ``engine`` renders the engine
    Deployment the operator would create for ``infd(name, ns)`` (its pod template: probes, volumes,
    security settings, spread; its rollout strategy and history limit), under the floor's own
    labels: no owner, no ConfigMaps, Service, PodDisruptionBudget or ServiceMonitor beside it, no
    operator, router or autoscaler watching. kwok mounts nothing, so the ConfigMaps the volumes
    name need not exist. ``minimal``: one container with a GPU limit (see ``FLOOR_PODS``)."""
    if pods not in FLOOR_PODS:
        raise ValueError(f"pods must be one of {FLOOR_PODS}, got {pods!r}")
    labels = {"app": name}
    if pods == "engine":
        engine = engine_deployment(name, ns)
        template = engine["spec"]["template"]
        template["metadata"]["labels"] = labels
        for spread in template["spec"].get("topologySpreadConstraints") or []:
            spread["labelSelector"] = {"matchLabels": labels}
        template["metadata"].setdefault("annotations", {})["rev"] = "1"
        spec_out = {**engine["spec"], "selector": {"matchLabels": labels}, "template": template}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": spec_out,
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": REPLICAS,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {"rev": "1"}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.product": BIG_PRODUCT},
                    "containers": [
                        {"name": "engine", "image": "engine:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                    ],
                },
            },
        },
    }


def deployment_ready(d: dict) -> bool:
    """Rolled and ready as `kubectl rollout status` says: every replica current and ready."""
    s, meta = d.get("status") or {}, d.get("metadata") or {}
    want = (d.get("spec") or {}).get("replicas", 1)
    return (
        s.get("observedGeneration") == meta.get("generation")
        and s.get("updatedReplicas", 0) == want
        and s.get("readyReplicas", 0) == want
        and s.get("replicas", 0) == want
    )


def condition(obj: dict, kind: str) -> dict:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def infd_ready(obj: dict) -> bool:
    """Ready with every replica ready, for the spec's current generation."""
    st = obj.get("status") or {}
    return (
        condition(obj, "Ready").get("status") == "True"
        and st.get("observedGeneration") == obj["metadata"].get("generation")
        and st.get("readyReplicas") == (obj.get("spec") or {}).get("replicas")
    )


def infd_rolled(obj: dict) -> bool:
    """A changed spec rolled out: Ready, and Progressing Complete (the engine Deployment's every
    replica current and ready, as ``deployment_ready`` asks of the floor) for that generation.
    Ready alone holds all through a rolling update (maxUnavailable 0), so it says nothing of it."""
    return (
        infd_ready(obj)
        and (obj["metadata"].get("generation") or 0) >= 2
        and condition(obj, "Progressing").get("reason") == "Complete"
        and condition(obj, "Progressing").get("observedGeneration") == obj["metadata"].get("generation")
    )
