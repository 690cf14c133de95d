"""Each side of a contract in kvfleet.contracts uses it: what one component writes, the other reads.

The operator's rendered children are read back as the router, the launcher, Prometheus' PromQL and
local mode read them; the engine's exposition is read by the autoscaler's and local mode's names.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet import contracts
from kvfleet.autoscaler.engine_metrics import parse_engine_metrics
from kvfleet.autoscaler.promql import MetricNames, deployment_queries
from kvfleet.crd import build_crd
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine_image.settings import LauncherSettings
from kvfleet.operator.render import Owner, render_children
from kvfleet.operator.settings import OperatorSettings
from kvfleet.router.kubernetes_source import slice_endpoints, slice_owner
from kvfleet.router.metrics import RouterMetrics
from kvfleet.spec import InferenceDeploymentSpec

NAME, NAMESPACE = "chat", "team-a"


def _spec(**routing: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"uri": "s3://models/llama", "servedName": "org/llama"},
            "engine": {"kind": "vllm"},
            "routing": routing,
        }
    )


def _children(spec: InferenceDeploymentSpec) -> dict[str, dict[str, Any]]:
    owner = Owner(name=NAME, namespace=NAMESPACE, uid="0000-uid")
    children = render_children(owner, spec, 2, OperatorSettings(), service_monitor=True)
    return {child["kind"]: child for child in children}


def _endpoint_slice(service: dict[str, Any], pod_ip: str) -> dict[str, Any]:
    """The EndpointSlice Kubernetes' EndpointSlice controller derives from a Service: the Service's
    labels and named ports (in no promised order: here reversed), one ready endpoint per pod."""
    meta = service["metadata"]
    ports = list(reversed(service["spec"]["ports"]))
    return {
        "metadata": {"name": f"{meta['name']}-abcde", "namespace": meta["namespace"], "labels": dict(meta["labels"])},
        "ports": [{"name": p["name"], "port": p["port"], "protocol": "TCP"} for p in ports],
        "endpoints": [
            {"addresses": [pod_ip], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": "chat-pod-0"}}
        ],
    }


def test_router_finds_the_replicas_of_the_operators_service() -> None:
    service = _children(_spec(kvEvents={"enabled": True}))["Service"]
    assert service["metadata"]["name"] == contracts.engine_name(NAME)
    assert service["metadata"]["labels"][contracts.DEPLOYMENT_LABEL] == NAME
    slice_obj = _endpoint_slice(service, "10.0.0.7")
    assert slice_owner((NAMESPACE, slice_obj["metadata"]["name"]), slice_obj) == (NAMESPACE, NAME)
    [endpoint] = slice_endpoints(slice_obj)
    assert endpoint.url == f"http://10.0.0.7:{contracts.ENGINE_HTTP_PORT}"
    assert endpoint.kv_events_port == contracts.KV_EVENTS_PORT


def test_every_child_carries_the_contract_labels() -> None:
    for kind, child in _children(_spec()).items():
        assert child["metadata"]["labels"] == contracts.engine_labels(NAME), kind
    template = _children(_spec())["Deployment"]["spec"]["template"]
    assert template["metadata"]["labels"][contracts.DEPLOYMENT_LABEL] == NAME
    assert contracts.SPEC_HASH_ANNOTATION in template["metadata"]["annotations"]


def test_launcher_defaults_are_where_the_operator_mounts_and_listens() -> None:
    pod = _children(_spec(kvEvents={"enabled": True}))["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    items = {item["key"]: item["path"] for item in volumes["spec"]["configMap"]["items"]}
    pin_items = {item["key"]: item["path"] for item in volumes["pin"]["configMap"]["items"]}
    launcher = LauncherSettings()
    assert launcher.spec_path.as_posix() == f"{mounts['spec']}/{items[contracts.SPEC_FILE]}"
    assert launcher.pin_path.as_posix() == f"{mounts['pin']}/{pin_items[contracts.PIN_KEY]}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert launcher.node_cache_dir.as_posix() == env["KVFLEET_NODE_CACHE"] == mounts["node-cache"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        contracts.ENGINE_HTTP_PORT_NAME: launcher.engine_port,
        contracts.LAUNCHER_PORT_NAME: launcher.metrics_port,
        contracts.KV_EVENTS_PORT_NAME: launcher.kv_events_port,
        # The engine binds its events' replay socket on the next port (engine_args.kv_events_config).
        contracts.KV_EVENTS_REPLAY_PORT_NAME: contracts.kv_events_replay_port(launcher.kv_events_port),
    }


@pytest.mark.parametrize(
    ("pod", "matches"),
    [("chat-engine-7d9f8c5b4-x2kqz", True), ("chat-engine2-7d9f8c5b4-x2kqz", False), ("chatty-engine-1-a", False)],
)
def test_gpu_query_selects_the_operators_engine_pods(pod: str, matches: bool) -> None:
    """DCGM labels a GPU with its consumer's pod name; the Deployment's pods are named after it."""
    query = deployment_queries("org/llama", NAMESPACE, NAME)["gpu_utilization"]
    [regex] = re.findall(r'pod=~"([^"]+)"', query)
    assert regex == contracts.engine_pod_regex(NAME)
    assert pod.startswith(_children(_spec())["Deployment"]["metadata"]["name"] + "-") is matches
    # PromQL regexes are anchored at both ends.
    assert (re.fullmatch(regex, pod) is not None) is matches


def _engine_exposition() -> str:
    metrics = EngineMetrics("org/llama")
    metrics.num_requests_running.labels("org/llama").set(3)
    metrics.num_requests_waiting.labels("org/llama").set(2)
    metrics.kv_cache_usage_perc.labels("org/llama").set(0.5)
    metrics.prefix_cache_queries.labels("org/llama").inc(100)
    metrics.prefix_cache_hits.labels("org/llama").inc(40)
    metrics.time_to_first_token.labels("org/llama").observe(0.2)
    return generate_latest(metrics.registry).decode()


def test_autoscaler_names_are_the_engines_series() -> None:
    exposed = {s.name for f in text_string_to_metric_families(_engine_exposition()) for s in f.samples}
    names = MetricNames()
    for name in (names.engine_running, names.kv_cache_usage, names.ttft_bucket):
        assert name in exposed, name
    both = [n for n in exposed if re.fullmatch(names.engine_running_waiting_regex, n)]
    assert sorted(both) == [contracts.VLLM_NUM_REQUESTS_RUNNING, contracts.VLLM_NUM_REQUESTS_WAITING]


def test_autoscaler_names_are_the_routers_series() -> None:
    metrics = RouterMetrics()
    metrics.requests.inc((NAMESPACE, "org/llama", "200"))
    metrics.queue_depth.labels(NAMESPACE, "org/llama").set(1)
    metrics.track_inflight(lambda: [(NAMESPACE, "org/llama", "r0", 2, 1)])
    samples = {s.name: s.labels for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    names = MetricNames()
    for name in (names.router_requests_total, names.router_queue_depth, names.router_inflight):
        assert samples[name]["namespace"] == NAMESPACE, name
        assert samples[name]["model"] == "org/llama", name


def test_the_autoscaler_reads_the_engines_series() -> None:
    sample = parse_engine_metrics(_engine_exposition())
    assert (sample.running, sample.waiting, sample.kv_cache_usage) == (3, 2, (0.5,))
    assert (sample.prefix_queries, sample.prefix_hits) == (100, 40)
    assert sum(1 for v in sample.ttft_buckets.values() if v == 1) >= 1


def test_crd_and_spec_share_the_model_uri_pattern() -> None:
    crd = build_crd()
    uri = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert uri["properties"]["uri"]["pattern"] == contracts.MODEL_URI_PATTERN
    for scheme in contracts.MODEL_URI_SCHEMES:
        InferenceDeploymentSpec.model_validate({"model": {"uri": f"{scheme}://bucket/x"}})
    with pytest.raises(ValueError, match="unknown URI scheme 'ftp'"):
        InferenceDeploymentSpec.model_validate({"model": {"uri": "ftp://bucket/x"}})
