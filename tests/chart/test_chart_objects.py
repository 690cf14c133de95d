"""Every rendered object is valid Kubernetes, runs locked down, and asks for no wildcard access."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from .conftest import CI_VALUES, objects, render

Render = Callable[[Path], list[dict[str, Any]]]
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion; ValidatingAdmissionPolicy v1 is GA
# in 1.30) and the newest the validator knows.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

# kubernetes-validate knows the built-in kinds only. For the Prometheus Operator kinds this is the
# subset of their published schema that the chart uses (monitoring.coreos.com/v1 API reference):
# enough to catch a misplaced or misspelled field without the real CRDs (tests/k8s/test_chart_real.py
# applies the same objects to a real API server that has them).
_STR = {"type": "string"}
_STRMAP = {"type": "object", "additionalProperties": _STR}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": _STRMAP},
                    },
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}},
                    },
                    "targetLabels": {"type": "array", "items": _STR},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["port"],
                            "properties": {
                                "port": _STR,
                                "path": _STR,
                                "interval": _DURATION,
                                "scrapeTimeout": _DURATION,
                                "honorLabels": {"type": "boolean"},
                                "relabelings": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "action": {
                                                "enum": [
                                                    "replace",
                                                    "keep",
                                                    "drop",
                                                    "labelmap",
                                                    "labeldrop",
                                                    "labelkeep",
                                                ]
                                            },
                                            "sourceLabels": {"type": "array", "items": _STR},
                                            "separator": _STR,
                                            "targetLabel": _STR,
                                            "regex": _STR,
                                            "replacement": _STR,
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "rules"],
                            "properties": {
                                "name": _STR,
                                "interval": _DURATION,
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["expr"],
                                        "properties": {
                                            "record": _STR,
                                            "alert": _STR,
                                            "expr": _STR,
                                            "for": _DURATION,
                                            "labels": _STRMAP,
                                            "annotations": _STRMAP,
                                        },
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
    },
}


def pod_specs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield doc["spec"]["template"]["spec"]
    elif doc["kind"] == "Pod":
        yield doc["spec"]


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_every_object_passes_kubernetes_schema_validation(values_file: Path, render_ci: Render) -> None:
    docs = render_ci(values_file)
    assert docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in MONITORING_SCHEMAS:
            jsonschema.validate(doc, MONITORING_SCHEMAS[doc["kind"]])
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{values_file.name}: {name} is invalid for Kubernetes {version}: {e}")


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_every_pod_is_locked_down(values_file: Path, render_ci: Render) -> None:
    specs = [spec for doc in render_ci(values_file) for spec in pod_specs(doc)]
    assert len(specs) == 3
    for spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        assert "hostNetwork" not in spec and "hostPID" not in spec
        for container in spec["containers"] + spec.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"] == {"drop": ["ALL"]}
            assert not ctx.get("privileged", False)
        assert all("hostPath" not in v for v in spec.get("volumes", []))


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_no_rbac_rule_has_a_wildcard(values_file: Path, render_ci: Render) -> None:
    roles = [d for d in render_ci(values_file) if d["kind"] in ("Role", "ClusterRole")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert not any("*" in item for item in rule.get(key, [])), f"{role['metadata']['name']}: {rule}"
            assert set(rule["verbs"]) <= {"get", "list", "watch", "create", "update", "patch", "delete"}, rule
            # Secrets are never readable: the engines mount them by reference, kvfleet never reads them.
            assert "secrets" not in rule["resources"], rule


def test_only_the_operator_touches_workloads(render_ci: Render) -> None:
    docs = render_ci(next(p for p in CI_VALUES if p.name == "minimal-values.yaml"))
    writes = {"create", "update", "patch", "delete"}
    for role in (d for d in docs if d["kind"] == "ClusterRole"):
        component = role["metadata"]["labels"]["app.kubernetes.io/component"]
        written = {r for rule in role["rules"] if writes & set(rule["verbs"]) for r in rule["resources"]}
        expected = {
            "operator": {
                "inferencedeployments",
                "inferencedeployments/status",
                "inferencedeployments/finalizers",
                "deployments",
                "services",
                "configmaps",
                "poddisruptionbudgets",
                "servicemonitors",
                "events",
            },
            "autoscaler": {"inferencedeployments/status"},
            "router": set(),
        }[component]
        assert written == expected, component


def test_router_service_monitor_keeps_the_models_namespace_label() -> None:
    """The router labels per-model series with each deployment's namespace: its ServiceMonitor honors
    the scraped labels (else Prometheus renames them exported_namespace), and so does the autoscaler's."""
    docs = objects(render({"monitoring": {"serviceMonitors": {"enabled": True}}}))
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    honor = {name.rsplit("-", 1)[-1]: m["spec"]["endpoints"][0].get("honorLabels") for name, m in monitors.items()}
    assert honor == {"router": True, "autoscaler": True}
