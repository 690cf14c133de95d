"""The chart's spec policy on a real API server, installed with the real helm binary: its
ValidatingAdmissionPolicy refuses `kubectl apply` of each disallowed spec naming the field and the
policy, and lets an allowed one through; with admission turned off, the operator (started with the
policy file the chart rendered) refuses the same spec in status and with an Event. The chart's
NetworkPolicies pass the API server's own validation (kwok runs no CNI, so their enforcement is not
tested here)."""

from __future__ import annotations

import copy
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.real_cluster import ComponentProcess, Kubectl, condition, wait_for

from kvfleet.devcluster.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
POLICY = {
    "nodeCacheHostPaths": ["/var/lib/kvfleet/models"],
    "imageRegistries": ["ghcr.io/kvfleet"],
    "priorityClasses": ["inference-high"],
    "tolerationKeys": ["nvidia.com/gpu"],
}

# (case, spec fields merged into tiny.yaml, the field and the policy the refusal must name)
REFUSED = [
    (
        "node-hostpath",
        {"cache": {"nodeCache": {"type": "hostPath", "hostPath": "/etc"}}},
        "spec.cache.nodeCache.hostPath: host path /etc is not allowed by the platform policy nodeCacheHostPaths",
    ),
    (
        "sibling-dir",
        {"cache": {"nodeCache": {"type": "hostPath", "hostPath": "/var/lib/kvfleet/models-x"}}},
        "platform policy nodeCacheHostPaths",
    ),
    (
        "image",
        {"engine": {"kind": "reference", "image": "docker.io/attacker/engine:1"}},
        "spec.engine.image: image docker.io/attacker/engine:1 is not from a registry allowed by the platform "
        "policy imageRegistries",
    ),
    (
        "lookalike",
        {"engine": {"kind": "reference", "image": "ghcr.io/kvfleet-x/engine:1"}},
        "platform policy imageRegistries",
    ),
    (
        "priority",
        {"scheduling": {"priorityClassName": "system-node-critical"}},
        "spec.scheduling.priorityClassName: PriorityClass system-node-critical is not allowed by the platform "
        "policy priorityClasses",
    ),
    (
        "toleration",
        {"scheduling": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}},
        "a toleration with key node-role.kubernetes.io/control-plane is not allowed by the platform policy "
        "tolerationKeys",
    ),
    (
        "every-taint",
        {"scheduling": {"tolerations": [{"operator": "Exists"}]}},
        "a toleration with no key (every taint) is not allowed by the platform policy tolerationKeys",
    ),
]
ALLOWED = {
    "cache": {"nodeCache": {"type": "hostPath", "hostPath": "/var/lib/kvfleet/models/team-a"}},
    "engine": {"kind": "reference", "image": "ghcr.io/kvfleet/engine-cpu:0.1.0"},
    "scheduling": {
        "priorityClassName": "inference-high",
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def spec_doc(namespace: str, name: str, fields: dict[str, Any]) -> dict[str, Any]:
    doc = next(d for d in yaml.safe_load_all((REPO / "examples" / "tiny.yaml").read_text()) if d)
    doc["metadata"] = {"name": name, "namespace": namespace}
    # Each its own served name: a refused spec still holds its claim (its old pods may still serve).
    doc["spec"] = merge(doc["spec"], {"model": {"servedName": name}})
    doc["spec"] = merge(doc["spec"], fields)
    return dict(doc)


Install = Callable[..., str]


@pytest.fixture
def install_chart(
    control_plane: ControlPlane, kubectl: Kubectl, crd_installed: None, namespace: str, tmp_path: Path
) -> Iterator[Install]:
    """helm install of the chart scoped to the test's namespace (so its admission binding touches no
    other test), with the CRD already there; uninstalled afterwards."""
    env = {**os.environ, **{k: str(tmp_path / k.lower()) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME")}}
    release = "kvpolicy"
    values = tmp_path / "values.yaml"

    def helm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(control_plane.settings.bin_dir / "helm"), "--kubeconfig", str(control_plane.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=False,
        )

    def install(admission: bool) -> str:
        values.write_text(
            yaml.safe_dump(
                {
                    "scope": {"mode": "namespace", "namespaces": [namespace]},
                    "policy": {**POLICY, "admission": {"enabled": admission}},
                    "networkPolicy": {"enabled": True},
                }
            )
        )
        result = helm("install", release, str(CHART), "-n", namespace, "-f", str(values), "--skip-crds")
        assert result.returncode == 0, result.stderr
        return release

    yield install
    helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")


def refused_by_admission(kubectl: Kubectl, doc: dict[str, Any]) -> str | None:
    result = kubectl.run("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc))
    return result.stderr if result.returncode != 0 else None


def test_admission_refuses_each_disallowed_spec_naming_the_field(
    kubectl: Kubectl, install_chart: Install, namespace: str
) -> None:
    release = install_chart(admission=True)
    name = f"{release}-kvfleet-spec-policy"
    # The API server compiles and type-checks the CEL against the CRD's schema; a warning here means
    # an expression that can never work.
    status = wait_for(
        lambda: (
            (s := (kubectl.get("validatingadmissionpolicy", name) or {}).get("status"))
            and "observedGeneration" in s
            and s
        ),
        30,
        "the policy's type check",
    )
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
    # Admission picks a new policy up within a second or two.
    first = spec_doc(namespace, "probe", REFUSED[0][1])
    wait_for(lambda: refused_by_admission(kubectl, first), 30, "the admission policy to take effect")

    for case, fields, message in REFUSED:
        result = kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(spec_doc(namespace, case, fields)))
        assert result.returncode != 0, f"{case} was accepted"
        assert f"ValidatingAdmissionPolicy '{name}'" in result.stderr, result.stderr
        assert message in result.stderr, result.stderr
        assert kubectl.get("infd", case, namespace) is None

    ok = spec_doc(namespace, "allowed", ALLOWED)
    kubectl.apply(ok)
    assert kubectl.get("infd", "allowed", namespace) is not None
    # Changing an accepted spec to a refused one is refused as well; a label-only change still passes.
    bad_update = merge(ok, {"spec": {"engine": {"image": "quay.io/x/y:1"}}})
    result = kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(bad_update))
    assert result.returncode != 0 and "spec.engine.image" in result.stderr, result.stderr
    kubectl("label", "infd", "allowed", "-n", namespace, "team=a")

    # The rendered NetworkPolicies are valid objects on this server (kwok has no CNI to enforce them).
    policies = kubectl.json("get", "networkpolicies", "-n", namespace)["items"]
    assert {p["metadata"]["name"] for p in policies} == {f"{release}-kvfleet-engines", f"{release}-kvfleet-autoscaler"}


def test_without_admission_the_operator_refuses_with_a_condition_and_an_event(
    kubectl: Kubectl,
    install_chart: Install,
    start_operator: Callable[..., ComponentProcess],
    namespace: str,
    tmp_path: Path,
) -> None:
    release = install_chart(admission=False)
    assert kubectl.get("validatingadmissionpolicy", f"{release}-kvfleet-spec-policy") is None
    # The operator runs as a local process (kwok runs no container) with the file the chart renders.
    config = kubectl.json("get", "configmap", f"{release}-kvfleet-policy", "-n", namespace)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(config["data"]["policy.yaml"])
    start_operator("--namespace", namespace, "--policy-file", str(policy_file))

    kubectl.apply(spec_doc(namespace, "hostpath", REFUSED[0][1]))  # nothing at admission stops it now
    degraded = wait_for(
        lambda: (
            (c := condition(kubectl.get("infd", "hostpath", namespace), "Degraded")) and c["status"] == "True" and c
        ),
        60,
        "Degraded",
    )
    assert degraded["reason"] == "PolicyViolation", degraded
    assert degraded["message"].startswith(REFUSED[0][2]), degraded["message"]
    events = wait_for(
        lambda: kubectl.json("get", "events", "-n", namespace, "--field-selector", "reason=PolicyViolation")["items"],
        30,
        "a PolicyViolation Event",
    )
    assert events[0]["type"] == "Warning" and "nodeCacheHostPaths" in events[0]["message"]
    assert kubectl.get("deployment", "hostpath-engine", namespace) is None

    kubectl.apply(spec_doc(namespace, "allowed", ALLOWED))
    wait_for(lambda: kubectl.get("deployment", "allowed-engine", namespace), 60, "the allowed spec's Deployment")
