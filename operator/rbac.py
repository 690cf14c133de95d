"""The operator's Kubernetes identity as data: ServiceAccount, ClusterRole with exact verbs, binding,
and kopf's peering CRD for HA. The Helm chart is built from ``render_install``; ``kvfleet operator
manifests`` writes it to deploy/operator.yaml and a test keeps that file in sync.

Every rule says why it is there. Nothing is a wildcard. Secrets are absent on purpose: the engine
pods reference them by name and the kubelet resolves them, so the operator never reads one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.spec import GROUP, PLURAL

NAME = "kvfleet-operator"
DEFAULT_NAMESPACE = "kvfleet-system"
PEERING_NAME = "kvfleet"
# The install manifest, relative to the source checkout (the chart is built from it).
INSTALL_FILE = "deploy/operator.yaml"


@dataclass(frozen=True)
class Rule:
    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str

    def to_k8s(self) -> dict[str, Any]:
        return {"apiGroups": [self.api_group], "resources": list(self.resources), "verbs": list(self.verbs)}


RULES: tuple[Rule, ...] = (
    Rule(
        GROUP,
        (PLURAL,),
        ("get", "list", "watch", "patch"),
        "watch InferenceDeployments; patch only to remove the finalizer an older operator version added (kopf)",
    ),
    Rule(GROUP, (f"{PLURAL}/status",), ("get", "patch"), "conditions, readyReplicas, endpoint, observedGeneration"),
    Rule(
        GROUP,
        (f"{PLURAL}/finalizers",),
        ("update",),
        "children carry ownerReferences with blockOwnerDeletion (OwnerReferencesPermissionEnforcement)",
    ),
    Rule(
        "apps",
        ("deployments",),
        ("get", "list", "watch", "create", "patch"),
        "engine Deployment: watched for drift (labelled children only), server-side apply (create on first "
        "apply); never deleted by the operator (garbage collection follows its ownerReference)",
    ),
    Rule(
        "",
        ("services", "configmaps"),
        ("get", "list", "watch", "create", "patch"),
        "engine Service and the launcher's spec ConfigMap, as above",
    ),
    Rule(
        "policy",
        ("poddisruptionbudgets",),
        ("get", "list", "watch", "create", "patch"),
        "engine PodDisruptionBudget",
    ),
    Rule(
        "monitoring.coreos.com",
        ("servicemonitors",),
        ("get", "list", "watch", "create", "patch"),
        "ServiceMonitor, only where the Prometheus Operator CRD exists (found through discovery)",
    ),
    Rule(
        "",
        ("pods",),
        ("list", "watch"),
        "engine pods (watched, labelled ones only): why unready ones fail, their launchers' pull progress, "
        "Ready ones' measured cold start",
    ),
    Rule("", ("events",), ("create",), "an Event per status transition"),
    Rule(
        "kopf.dev",
        ("clusterkopfpeerings",),
        ("get", "list", "watch", "patch"),
        "kopf peering: replicas see each other and only the highest priority one works",
    ),
)


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "kvfleet"}


def render_rbac(namespace: str = DEFAULT_NAMESPACE) -> list[dict[str, Any]]:
    """ServiceAccount, ClusterRole and ClusterRoleBinding of the operator."""
    meta = {"name": NAME, "labels": _labels()}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "namespace": namespace}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": [rule.to_k8s() for rule in RULES],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
    ]


def render_peering() -> list[dict[str, Any]]:
    """kopf's ClusterKopfPeering CRD (its documented schema) and the peering object replicas share."""
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "clusterkopfpeerings.kopf.dev"},
        "spec": {
            "scope": "Cluster",
            "group": "kopf.dev",
            "names": {"kind": "ClusterKopfPeering", "plural": "clusterkopfpeerings", "singular": "clusterkopfpeering"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                        }
                    },
                }
            ],
        },
    }
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING_NAME}}
    return [crd, peering]


def render_install(namespace: str = DEFAULT_NAMESPACE) -> list[dict[str, Any]]:
    return [*render_rbac(namespace), *render_peering()]
