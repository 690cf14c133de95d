"""The chart's spec policy (operator file + ValidatingAdmissionPolicy) and NetworkPolicies, rendered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from kvfleet.operator.policy import SpecPolicy, load_policy

from .conftest import CHART, objects, render


def docs_of(values: dict[str, Any]) -> list[dict[str, Any]]:
    return objects(render(values))


def one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return found


def operator_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", "-operator")["spec"]["template"]


def test_the_operator_reads_the_values_policy_from_its_mounted_file(tmp_path: Path) -> None:
    values = {"policy": {"nodeCacheHostPaths": ["/var/lib/kvfleet/"], "priorityClasses": ["inference-high"]}}
    docs = docs_of(values)
    pod = operator_pod(docs)
    container = pod["spec"]["containers"][0]
    assert "--policy-file=/etc/kvfleet/policy/policy.yaml" in container["args"]
    mount = {m["name"]: m for m in container["volumeMounts"]}["policy"]
    assert mount["mountPath"] == "/etc/kvfleet/policy" and mount["readOnly"] is True
    config = one(docs, "ConfigMap", "-policy")
    assert {v["name"]: v for v in pod["spec"]["volumes"]}["policy"]["configMap"]["name"] == config["metadata"]["name"]
    path = tmp_path / "policy.yaml"
    path.write_text(config["data"]["policy.yaml"])
    assert load_policy(path) == SpecPolicy(
        node_cache_host_paths=("/var/lib/kvfleet/",),
        image_registries=("ghcr.io/kvfleet",),
        priority_classes=("inference-high",),
        toleration_keys=("nvidia.com/gpu",),
    )
    # A changed policy changes the pod template, so the operator restarts and reads it.
    default = operator_pod(docs_of({}))["metadata"]["annotations"]["kvfleet.io/policy-checksum"]
    assert pod["metadata"]["annotations"]["kvfleet.io/policy-checksum"] != default
    # Router and autoscaler never see it.
    for component in ("-router", "-autoscaler"):
        volumes = one(docs, "Deployment", component)["spec"]["template"]["spec"]["volumes"]
        assert "policy" not in {v["name"] for v in volumes}


def test_the_admission_policy_carries_the_same_lists() -> None:
    docs = docs_of({"policy": {"nodeCacheHostPaths": ["/data/models/", "/"], "imageRegistries": ["*"]}})
    vap = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]  # cluster mode: every namespace
    variables = {v["name"]: v["expression"] for v in vap["spec"]["variables"]}
    # Trailing "/" dropped: the CEL adds the boundary, and "/" itself becomes "" (everything below root).
    assert yaml.safe_load(variables["allowedHostPaths"]) == ["/data/models", ""]
    assert yaml.safe_load(variables["allowedRegistries"]) == ["*"]
    assert yaml.safe_load(variables["allowedTolerationKeys"]) == ["nvidia.com/gpu"]
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert {r["resources"][0] for r in vap["spec"]["matchConstraints"]["resourceRules"]} == {"inferencedeployments"}
    messages = " ".join(v["messageExpression"] for v in vap["spec"]["validations"])
    for field in ("spec.cache.nodeCache.hostPath", "spec.engine.image", "spec.scheduling.priorityClassName"):
        assert field in messages


def test_admission_can_be_left_to_the_operator_and_follows_the_namespace_scope() -> None:
    kinds = {d["kind"] for d in docs_of({"policy": {"admission": {"enabled": False}}})}
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} & kinds
    binding = one(docs_of({"scope": {"mode": "namespace", "namespaces": ["a"]}}), "ValidatingAdmissionPolicyBinding")
    (expression,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expression == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a"]}


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"policy": {"nodeCacheHostPaths": ["var/lib"]}}, "/policy/nodeCacheHostPaths/0"),
        ({"policy": {"nodeCacheHostPaths": ["/var/../etc"]}}, "/policy/nodeCacheHostPaths/0"),
        ({"policy": {"imageRegistries": ["ghcr.io/x' || true"]}}, "/policy/imageRegistries/0"),
        ({"policy": {"priorityClasses": ["Not A Name"]}}, "/policy/priorityClasses/0"),
        ({"policy": {"tolerationKeys": [""]}}, "/policy/tolerationKeys/0"),
        ({"networkPolicy": {"engineNamespaces": ["Team_A"]}}, "/networkPolicy/engineNamespaces/0"),
    ],
)
def test_bad_policy_values_are_refused_naming_the_key(values: dict[str, Any], error: str) -> None:
    with helm_python.Chart.load(str(CHART)) as chart, pytest.raises(helm_python.HelmValuesError) as caught:
        chart.validate_schema(chart.merge_values(values))
    assert error in str(caught.value)


def peers(policy: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Port names -> the peers allowed to reach them."""
    found: dict[str, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            found.setdefault(port["port"], []).extend(rule["from"])
    return found


def component(peer: dict[str, Any]) -> str:
    return str(peer["podSelector"]["matchLabels"].get("app.kubernetes.io/component", "prometheus"))


def test_engines_take_traffic_from_routers_prometheus_and_the_operator_only() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"team": "obs"}}, "podSelector": {"matchLabels": {"app": "p"}}}
    docs = docs_of({"networkPolicy": {"engineNamespaces": ["team-a", "team-b"], "prometheus": prometheus}})
    engines = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-engines")]
    assert sorted(d["metadata"]["namespace"] for d in engines) == ["team-a", "team-b"]
    for policy in engines:
        assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kvfleet-engine"}}
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        allowed = peers(policy)
        assert sorted(component(p) for p in allowed["http"]) == ["prometheus", "router"]
        # The launcher: /coldstart for the operator, /metrics for Prometheus, /tokenizer/{name} for the
        # routers (they fetch tokenizers for KV events; router.kvEvents.fetchTokenizers).
        assert sorted(component(p) for p in allowed["launcher"]) == ["operator", "prometheus", "router"]
        # The KV-cache events carry prompts' token ids: routers only.
        assert [component(p) for p in allowed["kv-events"]] == ["router"]
        assert [component(p) for p in allowed["kv-replay"]] == ["router"], "the events' replay socket, the same"
        router = next(p for p in allowed["http"] if component(p) == "router")
        assert router["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kvfleet-system"}}
        assert next(p for p in allowed["http"] if component(p) == "prometheus") == prometheus


def test_the_events_port_stays_closed_when_kv_events_are_off() -> None:
    values = {"networkPolicy": {"engineNamespaces": ["team-a"]}, "router": {"kvEvents": {"enabled": False}}}
    (policy,) = [
        d for d in docs_of(values) if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-engines")
    ]
    assert "kv-events" not in peers(policy) and "kv-replay" not in peers(policy)
    assert sorted(component(p) for p in peers(policy)["launcher"]) == ["operator", "prometheus"]


def test_the_launcher_port_is_closed_to_routers_that_fetch_no_tokenizers() -> None:
    values = {"networkPolicy": {"engineNamespaces": ["team-a"]}, "router": {"kvEvents": {"fetchTokenizers": False}}}
    (policy,) = [
        d for d in docs_of(values) if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-engines")
    ]
    assert [component(p) for p in peers(policy)["kv-events"]] == ["router"]
    assert sorted(component(p) for p in peers(policy)["launcher"]) == ["operator", "prometheus"]


def test_the_wake_port_takes_routers_and_prometheus_only() -> None:
    autoscaler = one(docs_of({}), "NetworkPolicy", "-autoscaler")
    assert autoscaler["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "autoscaler"
    assert sorted(component(p) for p in peers(autoscaler)["http"]) == ["prometheus", "router"]


def test_which_namespaces_get_engine_policies() -> None:
    def engine_namespaces(values: dict[str, Any]) -> list[str]:
        return sorted(
            d["metadata"]["namespace"]
            for d in docs_of(values)
            if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-engines")
        )

    assert engine_namespaces({}) == []  # cluster mode: the chart cannot know the tenant namespaces
    assert engine_namespaces({"scope": {"mode": "namespace", "namespaces": ["ml"]}}) == ["ml"]
    assert engine_namespaces({"scope": {"mode": "namespace", "namespaces": []}}) == ["kvfleet-system"]
    assert not [d for d in docs_of({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_the_operator_gets_public_artifact_keys_and_the_chart_holds_no_private_key(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from kvfleet.operator.settings import OperatorSettings
    from kvfleet.weight_cache.signing import public_pem

    private = Ed25519PrivateKey.generate()
    keys = public_pem(private.public_key())
    docs = docs_of({"artifacts": {"publicKeys": keys}})
    container = operator_pod(docs)["spec"]["containers"][0]
    assert "--artifact-keys-file=/etc/kvfleet/policy/artifact-keys.pem" in container["args"]
    config = one(docs, "ConfigMap", "-policy")
    assert config["data"]["artifact-keys.pem"] == keys
    # What the operator reads there is what it accepts and passes on to engine pods.
    assert OperatorSettings(artifact_public_keys=config["data"]["artifact-keys.pem"]).artifact_public_keys == keys
    # A rotated key restarts the operator, which reads the file at start.
    default = operator_pod(docs_of({}))["metadata"]["annotations"]["kvfleet.io/policy-checksum"]
    assert operator_pod(docs)["metadata"]["annotations"]["kvfleet.io/policy-checksum"] != default
    # Without keys nothing is passed: engine pods then load no artifact.
    bare = docs_of({})
    assert not [a for a in operator_pod(bare)["spec"]["containers"][0]["args"] if "artifact" in a]
    assert "artifact-keys.pem" not in one(bare, "ConfigMap", "-policy")["data"]
    # No signing key anywhere in what the chart installs, and the schema refuses one in the value.
    assert all("PRIVATE KEY" not in yaml.safe_dump(d) for d in docs)
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    with helm_python.Chart.load(str(CHART)) as chart:
        for bad in (pem, keys + pem, "not a key"):
            with pytest.raises(helm_python.HelmValuesError, match="publicKeys"):
                chart.validate_schema(chart.merge_values({"artifacts": {"publicKeys": bad}}))
