"""The platform policy on what a spec may ask for, as a pure decision, and the operator enforcing it
against the API emulator: a refused spec creates no child and says why in status and an Event."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from support.real_cluster import condition

from kvfleet.operator.policy import UNRESTRICTED, SpecPolicy, load_policy, violations
from kvfleet.spec import InferenceDeploymentSpec
from kvfleet_testkit.kube_emulator import (
    DEPLOYMENTS,
    EVENTS,
    INFD,
    Cluster,
    RunningOperator,
    eventually,
    operator_settings,
    start_operator,
    stop_operator,
)

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
NS = "default"

# The chart's default (values.yaml `policy`), so these cases are what a default install enforces.
CHART_DEFAULT = SpecPolicy(
    node_cache_host_paths=(),
    image_registries=("ghcr.io/kvfleet",),
    priority_classes=(),
    toleration_keys=("nvidia.com/gpu",),
)
PLATFORM = SpecPolicy(
    node_cache_host_paths=("/var/lib/kvfleet/models/",),
    image_registries=("registry.example.com/inference", "ghcr.io/kvfleet"),
    priority_classes=("inference-high",),
    toleration_keys=("nvidia.com/gpu", "dedicated"),
)


def tiny(name: str = "tiny", **fields: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": "file:///models/tiny", "servedName": name},
        "engine": {"kind": "reference"},
        "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi", "shmSize": "256Mi"},
        "replicas": 1,
        **fields,
    }
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def events_for(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [
        obj.raw
        for (res, _ns, _n), obj in cluster.api.objects.items()
        if res == EVENTS and not obj.deleted and obj.raw.get("involvedObject", {}).get("name") == name
    ]


def spec(**fields: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"uri": "s3://model-cache/m"}, **fields})


def host_path(path: str) -> dict[str, Any]:
    return {"cache": {"nodeCache": {"type": "hostPath", "hostPath": path}}}


def toleration(key: str | None) -> dict[str, Any]:
    item = {"operator": "Exists", "effect": "NoSchedule"} | ({"key": key} if key else {})
    return {"scheduling": {"tolerations": [item]}}


ALLOWED = [
    ("defaults", CHART_DEFAULT, {}),
    ("gpu toleration", CHART_DEFAULT, toleration("nvidia.com/gpu")),
    ("kvfleet image", CHART_DEFAULT, {"engine": {"image": "ghcr.io/kvfleet/engine-vllm:0.2.0"}}),
    ("emptyDir", CHART_DEFAULT, {"cache": {"nodeCache": {"type": "emptyDir", "sizeLimit": "10Gi"}}}),
    ("the allowed directory", PLATFORM, host_path("/var/lib/kvfleet/models")),
    ("below it", PLATFORM, host_path("/var/lib/kvfleet/models/team-a")),
    ("second registry", PLATFORM, {"engine": {"image": "registry.example.com/inference/vllm@sha256:" + "a" * 64}}),
    ("priority class", PLATFORM, {"scheduling": {"priorityClassName": "inference-high"}}),
    ("anything", UNRESTRICTED, host_path("/") | toleration(None) | {"engine": {"image": "evil.io/x:1"}}),
]

REFUSED = [
    ("hostPath by default", CHART_DEFAULT, host_path("/var/lib/kvfleet/models"), "spec.cache.nodeCache.hostPath"),
    ("a sibling directory", PLATFORM, host_path("/var/lib/kvfleet/models-evil"), "spec.cache.nodeCache.hostPath"),
    ("a parent directory", PLATFORM, host_path("/var/lib/kvfleet"), "spec.cache.nodeCache.hostPath"),
    ("the node's root", PLATFORM, host_path("/"), "spec.cache.nodeCache.hostPath"),
    ("another registry", CHART_DEFAULT, {"engine": {"image": "docker.io/evil/engine:1"}}, "spec.engine.image"),
    ("a look-alike path", CHART_DEFAULT, {"engine": {"image": "ghcr.io/kvfleet-evil/x:1"}}, "spec.engine.image"),
    ("a look-alike host", CHART_DEFAULT, {"engine": {"image": "ghcr.io.evil.com/kvfleet/x"}}, "spec.engine.image"),
    ("no registry named", CHART_DEFAULT, {"engine": {"image": "engine:1"}}, "spec.engine.image"),
    (
        "priority class by default",
        CHART_DEFAULT,
        {"scheduling": {"priorityClassName": "system-node-critical"}},
        "spec.scheduling.priorityClassName",
    ),
    ("an unlisted taint", PLATFORM, toleration("node-role.kubernetes.io/control-plane"), "tolerations[0].key"),
    ("every taint", PLATFORM, toleration(None), "spec.scheduling.tolerations[0].key"),
]


@pytest.mark.parametrize(("name", "policy", "fields"), ALLOWED, ids=[c[0] for c in ALLOWED])
def test_allowed_specs_pass(name: str, policy: SpecPolicy, fields: dict[str, Any]) -> None:
    assert violations(spec(**fields), policy) == []


@pytest.mark.parametrize(("name", "policy", "fields", "field"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_specs_name_the_field_and_the_policy(
    name: str, policy: SpecPolicy, fields: dict[str, Any], field: str
) -> None:
    (found,) = violations(spec(**fields), policy)
    assert field in found.field
    assert f"platform policy {found.policy}" in found.message
    assert str(found).startswith(found.field + ": ")


def test_every_refused_field_is_reported_at_once() -> None:
    fields = host_path("/etc") | {"engine": {"image": "evil.io/x"}}
    fields["scheduling"] = {"priorityClassName": "p", "tolerations": [{"key": "a"}, {"key": "nvidia.com/gpu"}]}
    found = violations(spec(**fields), CHART_DEFAULT)
    assert [v.policy for v in found] == ["nodeCacheHostPaths", "imageRegistries", "priorityClasses", "tolerationKeys"]
    assert "(allowed: none)" in found[0].message


def test_the_policy_file_needs_every_list_and_refuses_bad_entries(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("nodeCacheHostPaths: [/data]\nimageRegistries: ['*']\npriorityClasses: []\ntolerationKeys: []\n")
    assert load_policy(path).node_cache_host_paths == ("/data",)
    path.write_text("nodeCacheHostPaths: []\n")
    with pytest.raises(ValidationError, match="imageRegistries"):
        load_policy(path)
    for bad in ("nodeCacheHostPaths: [relative]", "nodeCacheHostPaths: [/a/../etc]", "extra: 1"):
        path.write_text(bad + "\nimageRegistries: []\npriorityClasses: []\ntolerationKeys: []\n")
        with pytest.raises(ValidationError):
            load_policy(path)


@pytest.fixture
async def strict_operator(cluster: Cluster) -> AsyncIterator[RunningOperator]:
    running = await start_operator(cluster, operator_settings(policy=CHART_DEFAULT))
    try:
        yield running
    finally:
        await stop_operator(running)


async def test_operator_refuses_a_spec_outside_the_policy(cluster: Cluster, strict_operator: RunningOperator) -> None:
    await cluster.create_infd(tiny("hostpath", cache={"nodeCache": {"type": "hostPath", "hostPath": "/etc"}}))
    infd = await eventually(
        lambda: (o := cluster.get(INFD, NS, "hostpath")) and condition(o, "Degraded") and o, what="Degraded"
    )
    degraded = condition(infd, "Degraded")
    assert degraded is not None and (degraded["status"], degraded["reason"]) == ("True", "PolicyViolation")
    assert degraded["message"].startswith("spec.cache.nodeCache.hostPath: host path /etc is not allowed")
    assert (condition(infd, "Ready") or {}).get("reason") == "PolicyViolation"
    event = await eventually(
        lambda: next((e for e in events_for(cluster, "hostpath") if e["reason"] == "PolicyViolation"), None),
        what="a PolicyViolation event",
    )
    assert event["type"] == "Warning" and "nodeCacheHostPaths" in event["message"]
    assert cluster.get(DEPLOYMENTS, NS, "hostpath-engine") is None

    # Fixing the spec lifts the refusal: the children appear.
    await cluster.patch_infd(NS, "hostpath", {"spec": {"cache": {"nodeCache": {"type": "emptyDir", "hostPath": None}}}})
    await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "hostpath-engine"), what="the engine Deployment")


async def test_a_newly_refused_update_leaves_the_running_children(
    cluster: Cluster, strict_operator: RunningOperator
) -> None:
    await cluster.create_infd(tiny())
    dep = await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
    await cluster.patch_infd(NS, "tiny", {"spec": {"scheduling": {"priorityClassName": "system-cluster-critical"}}})
    infd = await eventually(
        lambda: (
            (o := cluster.get(INFD, NS, "tiny"))
            and (condition(o, "Degraded") or {}).get("reason") == "PolicyViolation"
            and o
        ),
        what="Degraded/PolicyViolation",
    )
    assert "spec.scheduling.priorityClassName" in condition(infd, "Degraded")["message"]  # type: ignore[index]
    assert cluster.get(DEPLOYMENTS, NS, "tiny-engine")["spec"] == dep["spec"]  # type: ignore[index]
