"""The chart lints, renders for every CI scenario, and refuses bad values with the failing key."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from .conftest import CHART, CI_VALUES, NAMESPACE, RELEASE, REPO_ROOT, load_values, objects, render

BAD_CASES = yaml.safe_load((Path(__file__).parent / "fixtures" / "bad-values.yaml").read_text())
Render = Callable[[Path], list[dict[str, Any]]]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def test_every_scenario_has_a_ci_values_file() -> None:
    assert {p.name for p in CI_VALUES} == {
        "minimal-values.yaml",
        "ha-values.yaml",
        "namespaced-values.yaml",
        "no-monitoring-values.yaml",
    }


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_lint_is_clean(values_file: Path) -> None:
    report = helm_python.lint(str(CHART), values=load_values(values_file), strict=True, namespace="kvfleet-system")
    assert report["errors"] == []
    # Strict lint turns warnings into errors; the one info message left is the missing icon.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_renders_the_components(values_file: Path, render_ci: Render) -> None:
    docs = render_ci(values_file)
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert deployments == {"kvf-kvfleet-operator", "kvf-kvfleet-router", "kvf-kvfleet-autoscaler"}
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    # One Service per component, plus the routers' headless one for their load reports (peer load, on by default).
    assert services - {"kvf-kvfleet-router-peers"} == deployments
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
        assert container["readinessProbe"]["httpGet"]["port"] == "http"


def test_minimal_is_the_defaults_with_one_router(render_ci: Render) -> None:
    docs = render_ci(CHART / "ci" / "minimal-values.yaml")
    assert "PodDisruptionBudget" not in kinds(docs)  # one router: a budget would block drains
    assert "ServiceMonitor" not in kinds(docs) and "PrometheusRule" not in kinds(docs)
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap" and not d["metadata"]["name"].endswith("-policy")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["kvfleet.json"] == (CHART / "dashboards" / "kvfleet.json").read_text().rstrip("\n")


def test_ha_spreads_routers_and_keeps_two_through_drains(render_ci: Render) -> None:
    docs = render_ci(CHART / "ci" / "ha-values.yaml")
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    assert router["spec"]["replicas"] == 3
    assert router["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    (spread,) = router["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone" and spread["whenUnsatisfiable"] == "DoNotSchedule"
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    image = router["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith("@sha256:" + "0" * 64)
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator"))
    assert operator["spec"]["replicas"] == 1 and operator["spec"]["strategy"] == {"type": "Recreate"}
    # Two autoscalers: the Lease lets one act, so a rolling update never has two acting at once.
    autoscaler = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-autoscaler"))
    assert autoscaler["spec"]["replicas"] == 2 and autoscaler["spec"]["strategy"]["type"] == "RollingUpdate"
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    # The router and the autoscaler; the operator has no /metrics and creates the engines' monitors itself.
    assert {m["metadata"]["name"] for m in monitors} == {"kvf-kvfleet-router", "kvf-kvfleet-autoscaler"}
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert all(a["labels"]["team"] == "ml-platform" for a in alerts)


def test_namespaced_mode_grants_nothing_cluster_wide(render_ci: Render) -> None:
    docs = render_ci(CHART / "ci" / "namespaced-values.yaml")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role"}
    watched = {("team-a", f"kvf-kvfleet-{c}") for c in ("operator", "router", "autoscaler")}
    # One autoscaler holds no Lease, so nothing in its own namespace (two: test_chart_rbac.py).
    assert roles == watched
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        (subject,) = binding["subjects"]
        assert subject["namespace"] == "kvfleet-system"  # the ServiceAccounts live in the release namespace
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--namespace=team-a" in args and "--all-namespaces" not in args
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "KvfleetTTFTSLOBurnSlow" not in alerts and "KvfleetTTFTSLOBurnFast" in alerts


def test_several_namespaces_get_a_role_each_with_the_operator_alone() -> None:
    values = {
        "scope": {"mode": "namespace", "namespaces": ["team-a", "team-b"]},
        "router": {"enabled": False},
        "autoscaler": {"enabled": False},
    }
    docs = objects(render(values))
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role"}
    assert roles == {(ns, "kvf-kvfleet-operator") for ns in ("team-a", "team-b")}
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator"))
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_namespaced_mode_defaults_to_the_release_namespace() -> None:
    docs = objects(render({"scope": {"mode": "namespace"}}, namespace="ml"))
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] in ("Role", "RoleBinding")} == {"ml"}


def test_no_monitoring_renders_no_monitoring_objects(render_ci: Render) -> None:
    docs = render_ci(CHART / "ci" / "no-monitoring-values.yaml")
    assert not {"ServiceMonitor", "PrometheusRule"} & set(kinds(docs))
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"] == ["kvf-kvfleet-policy"]
    autoscaler = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-autoscaler"))
    args = autoscaler["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--prometheus-url=http://prometheus-server.monitoring.svc" in args


def test_router_wakes_through_the_autoscaler_service(render_ci: Render) -> None:
    docs = render_ci(CHART / "ci" / "minimal-values.yaml")
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--autoscaler-url=http://kvf-kvfleet-autoscaler.kvfleet-system.svc:8081" in args
    without = objects(render({"autoscaler": {"enabled": False}}))
    router = next(d for d in without if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    assert not [
        a for a in router["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--autoscaler-url")
    ]


def test_chart_crd_is_the_generated_file() -> None:
    generated = REPO_ROOT / "crds" / "inferencedeployments.kvfleet.io.yaml"
    assert (CHART / "crds" / generated.name).read_bytes() == generated.read_bytes(), (
        f"copy {generated.relative_to(REPO_ROOT)} to charts/kvfleet/crds/ (run `kvfleet crd generate` first)"
    )
    with helm_python.Chart.load(str(CHART)) as chart:
        (crd,) = chart.crds
    assert yaml.safe_load(crd["data"])["metadata"]["name"] == "inferencedeployments.kvfleet.io"


@pytest.mark.parametrize("case", BAD_CASES, ids=[c["name"] for c in BAD_CASES])
def test_bad_values_are_refused_naming_the_key(case: dict[str, Any]) -> None:
    with helm_python.Chart.load(str(CHART)) as chart:
        merged = chart.merge_values(case["values"])
        if case["stage"] == "schema":
            with pytest.raises(helm_python.HelmValuesError) as caught:
                chart.validate_schema(merged)
        else:
            chart.validate_schema(merged)
            with pytest.raises(helm_python.HelmRenderError) as caught:
                chart.render(values=case["values"], name="kvf", namespace="kvfleet-system", is_install=True)
    assert case["error"] in str(caught.value)


def test_lint_rejects_a_bad_values_file() -> None:
    bad = yaml.safe_load((Path(__file__).parent / "fixtures" / "bad-values-file.yaml").read_text())
    report = helm_python.lint(str(CHART), values=bad)
    joined = "\n".join(report["errors"])
    assert "/router/replicas" in joined and "'maxUnavailable' not allowed" in joined


def test_the_wake_token_reaches_the_routers_and_the_autoscaler_only(render_ci: Render) -> None:
    """A wake starts GPUs: one generated Secret, mounted read-only into the router and autoscaler
    pods (never the operator's or an engine's), and both are told where it is."""
    import base64

    rendered = render_ci(CHART / "ci" / "minimal-values.yaml")
    (secret,) = [o for o in rendered if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-wake-token")]
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    flag = "--wake-token-file=/var/run/kvfleet/wake/token"
    for d in (o for o in rendered if o["kind"] == "Deployment"):
        component = d["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = d["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        if component in ("router", "autoscaler"):
            assert flag in pod["containers"][0]["args"], component
            assert mounts["wake-token"]["readOnly"] is True
            assert volumes["wake-token"]["secret"]["secretName"] == secret["metadata"]["name"]
        else:
            assert "wake-token" not in volumes, component


def router_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    return dict(router["spec"]["template"]["spec"])


def test_router_subscribes_to_kv_events_and_mounts_the_listed_tokenizers() -> None:
    tokenizers = [
        {
            "model": "llama",
            "volume": {"persistentVolumeClaim": {"claimName": "tokenizers", "readOnly": True}},
            "subPath": "llama-3.1-8b",
        },
        {"model": "qwen", "volume": {"configMap": {"name": "qwen-tokenizer"}}},
    ]
    pod = router_pod(objects(render({"router": {"kvEvents": {"tokenizers": tokenizers}}})))
    container = pod["containers"][0]
    args = container["args"]
    assert "--kv-events-port=5557" in args and "--kv-events-announced-only" in args
    assert [a for a in args if a.startswith("--kv-events-tokenizer=")] == [
        "--kv-events-tokenizer=llama=/var/lib/kvfleet/tokenizers/0/llama-3.1-8b",
        "--kv-events-tokenizer=qwen=/var/lib/kvfleet/tokenizers/1",
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tokenizer-0"]["persistentVolumeClaim"] == {"claimName": "tokenizers", "readOnly": True}
    assert volumes["tokenizer-1"]["configMap"] == {"name": "qwen-tokenizer"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["tokenizer-1"] == {
        "name": "tokenizer-1",
        "mountPath": "/var/lib/kvfleet/tokenizers/1",
        "readOnly": True,
    }
    assert "--no-kv-events-fetch-tokenizers" not in args  # unlisted models: fetched from their engines
    # The default (no tokenizers listed) subscribes too: tokenizers are fetched from the engines' launchers.
    args = router_pod(objects(render({})))["containers"][0]["args"]
    assert [a for a in args if a.startswith("--kv-events")] == ["--kv-events-port=5557", "--kv-events-announced-only"]
    # Fetching off: only the listed models are tokenized.
    pod = router_pod(objects(render({"router": {"kvEvents": {"fetchTokenizers": False, "tokenizers": tokenizers}}})))
    assert "--no-kv-events-fetch-tokenizers" in pod["containers"][0]["args"]
    # With events off, nothing is subscribed to, fetched or mounted.
    pod = router_pod(objects(render({"router": {"kvEvents": {"enabled": False, "tokenizers": tokenizers}}})))
    assert not [a for a in pod["containers"][0]["args"] if a.startswith(("--kv-events", "--no-kv-events"))]
    assert not [v for v in pod["volumes"] if v["name"].startswith("tokenizer-")]


def test_routers_exchange_load_through_a_headless_service_with_a_key_of_their_own() -> None:
    rendered = objects(render({"router": {"peerLoad": {"enabled": True, "port": 7411}}}))
    pod = router_pod(rendered)
    container = pod["containers"][0]
    args = container["args"]
    assert "--peer-load-port=7411" in args
    (peer,) = [a for a in args if a.startswith("--peer-load-peer=")]
    assert peer.startswith(f"--peer-load-peer={RELEASE}") and peer.endswith(f"-router-peers.{NAMESPACE}.svc:7411")
    assert "--peer-load-key-file=/var/run/kvfleet/peer-load/key" in args
    volumes = {v["name"]: v for v in pod["volumes"]}
    key_secret = volumes["peer-load-key"]["secret"]["secretName"]
    assert {"name": "peer-load-key", "mountPath": "/var/run/kvfleet/peer-load", "readOnly": True} in container[
        "volumeMounts"
    ]
    secrets = [o for o in rendered if o["kind"] == "Secret" and o["metadata"]["name"] == key_secret]
    assert len(secrets) == 1 and len(base64.b64decode(secrets[0]["data"]["key"])) >= 32
    # Only the router pods mount it.
    mounted_by = [
        o["metadata"]["name"]
        for o in rendered
        if o["kind"] == "Deployment"
        and any(v.get("secret", {}).get("secretName") == key_secret for v in o["spec"]["template"]["spec"]["volumes"])
    ]
    assert len(mounted_by) == 1 and mounted_by[0].endswith("-router")
    (service,) = [o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"].endswith("-router-peers")]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"] == [{"name": "peer-load", "port": 7411, "targetPort": 7411, "protocol": "UDP"}]
    # On by default (the default install runs 2 routers); off: no flag, no Secret, no Service.
    assert [a for a in router_pod(objects(render({})))["containers"][0]["args"] if a.startswith("--peer-load-port")]
    rendered = objects(render({"router": {"peerLoad": {"enabled": False}}}))
    assert not [a for a in router_pod(rendered)["containers"][0]["args"] if a.startswith("--peer-load")]
    assert not [o for o in rendered if o["metadata"]["name"].endswith(("-peer-load-key", "-router-peers"))]
