"""The chart grants each component exactly the rules it uses: no more, no fewer.

The operator publishes its rules as data (operator/rbac.py, the source of deploy/operator.yaml);
the chart's must equal them. The router and the autoscaler publish none as data, so their expected
rules are written here from the API calls their code makes, each with the call it comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfleet.autoscaler.settings import LeaseSettings
from kvfleet.operator.rbac import RULES

from .conftest import CHART, RELEASE, objects, render

Render = Callable[[Path], list[dict[str, Any]]]

# (apiGroup, resource, verb, resourceName or "") for every permission a rule list grants.
Grant = tuple[str, str, str, str]

# The one published operator rule the chart leaves out, and why.
OPERATOR_LEFT_OUT = {
    ("kopf.dev", "clusterkopfpeerings"): "the chart runs one operator without --peering (standalone): "
    "kopf never reads a peering object"
}

LEASE_NAME = LeaseSettings(namespace="default", identity="x").name  # the default Lease name

EXPECTED: dict[str, list[dict[str, Any]]] = {
    "operator": [rule.to_k8s() for rule in RULES if (rule.api_group, *rule.resources) not in OPERATOR_LEFT_OUT],
    "router": [
        # router/kubernetes_source.py through kvfleet/kube/watch.py: list once, then watch, on both kinds.
        {"apiGroups": ["kvfleet.io"], "resources": ["inferencedeployments"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ],
    "autoscaler": [
        # autoscaler/deployments.py lists once, then watches; autoscaler/actuators.py merge-patches /status.
        {"apiGroups": ["kvfleet.io"], "resources": ["inferencedeployments"], "verbs": ["list", "watch"]},
        {"apiGroups": ["kvfleet.io"], "resources": ["inferencedeployments/status"], "verbs": ["patch"]},
    ],
}
# autoscaler/leader.py: get, create and merge-patch of its one Lease, in its own namespace.
EXPECTED_AUTOSCALER_SELF = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": [LEASE_NAME],
        "verbs": ["get", "patch"],
    },
]


def grants(rules: list[dict[str, Any]]) -> set[Grant]:
    found: set[Grant] = set()
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [""]:
                        found.add((group, resource, verb, name))
    return found


def roles(docs: list[dict[str, Any]], kind: str) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(namespace or "", name) -> rules of every role of this kind."""
    return {(d["metadata"].get("namespace", ""), d["metadata"]["name"]): d["rules"] for d in docs if d["kind"] == kind}


def test_operator_rules_are_published_ones_less_only_peering() -> None:
    left_out = [rule for rule in RULES if (rule.api_group, *rule.resources) in OPERATOR_LEFT_OUT]
    assert len(left_out) == len(OPERATOR_LEFT_OUT), "operator/rbac.py no longer has the rule the chart leaves out"
    assert len(EXPECTED["operator"]) == len(RULES) - len(left_out)


@pytest.mark.parametrize("component", ["operator", "router", "autoscaler"])
def test_cluster_mode_grants_exactly_the_published_rules(component: str, render_ci: Render) -> None:
    docs = render_ci(CHART / "ci" / "minimal-values.yaml")
    cluster_roles = roles(docs, "ClusterRole")
    rules = cluster_roles[("", f"{RELEASE}-kvfleet-{component}")]
    assert rules == EXPECTED[component]
    assert len(grants(rules)) == sum(len(r["resources"]) * len(r["verbs"]) for r in rules), "a rule repeats another"


@pytest.mark.parametrize("component", ["operator", "router", "autoscaler"])
def test_namespace_mode_grants_the_same_rules_in_the_namespace_only(component: str, render_ci: Render) -> None:
    docs = render_ci(CHART / "ci" / "namespaced-values.yaml")
    assert not roles(docs, "ClusterRole"), "namespace mode grants nothing cluster-wide"
    assert roles(docs, "Role")[("team-a", f"{RELEASE}-kvfleet-{component}")] == EXPECTED[component]


@pytest.mark.parametrize("values", [{}, {"scope": {"mode": "namespace", "namespaces": ["team-a"]}}], ids=str)
def test_the_autoscaler_lease_is_granted_in_its_own_namespace_only(values: dict[str, Any]) -> None:
    docs = objects(render({**values, "autoscaler": {"replicas": 2}}, namespace="kvfleet-system"))
    own = roles(docs, "Role")
    assert own[("kvfleet-system", f"{RELEASE}-kvfleet-autoscaler-self")] == EXPECTED_AUTOSCALER_SELF
    lease_grants = {g for rules in own.values() for g in grants(rules) if g[1] == "leases"}
    lease_grants |= {g for rules in roles(docs, "ClusterRole").values() for g in grants(rules) if g[1] == "leases"}
    assert lease_grants == grants(EXPECTED_AUTOSCALER_SELF)
    (binding,) = [
        d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == f"{RELEASE}-kvfleet-autoscaler-self"
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-kvfleet-autoscaler", "namespace": "kvfleet-system"}
    ]


@pytest.mark.parametrize("values", [{}, {"scope": {"mode": "namespace", "namespaces": ["team-a"]}}], ids=str)
def test_one_autoscaler_is_granted_no_lease(values: dict[str, Any]) -> None:
    # One replica elects no leader (its Recreate strategy keeps two from acting at once): no Lease
    # rule anywhere, and the autoscaler runs with --no-leader-election.
    docs = objects(render(values, namespace="kvfleet-system"))
    everything = [*roles(docs, "Role").values(), *roles(docs, "ClusterRole").values()]
    assert not {g for rules in everything for g in grants(rules) if g[1] == "leases"}
    assert not [d for d in docs if d["metadata"]["name"] == f"{RELEASE}-kvfleet-autoscaler-self"]
    (autoscaler,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-autoscaler")]
    assert autoscaler["spec"]["strategy"] == {"type": "Recreate"}
    assert "--no-leader-election" in autoscaler["spec"]["template"]["spec"]["containers"][0]["args"]


def test_rbac_create_false_renders_no_roles() -> None:
    docs = objects(render({"rbac": {"create": False}}))
    assert not [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
