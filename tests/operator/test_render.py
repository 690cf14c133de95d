"""Pure renderers: table-driven, hand-checkable, no cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.operator import names
from kvfleet.operator.pod import pod_spec_hash, startup_budget_s, termination_grace_s
from kvfleet.operator.policy import SpecPolicy
from kvfleet.operator.render import Owner, render_children, render_deployment, spec_json
from kvfleet.operator.settings import OperatorSettings
from kvfleet.spec import InferenceDeploymentSpec

SETTINGS = OperatorSettings()
OWNER = Owner(name="m", namespace="ns", uid="uid-1")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def spec(**fields: Any) -> InferenceDeploymentSpec:
    base: dict[str, Any] = {"model": {"uri": "s3://model-cache/models/m"}}
    base.update(fields)
    return InferenceDeploymentSpec.model_validate(base)


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dict(dep["spec"]["template"]["spec"]["containers"][0])


def pod(dep: dict[str, Any]) -> dict[str, Any]:
    return dict(dep["spec"]["template"]["spec"])


@pytest.mark.parametrize(
    ("resources", "engine", "gpu_limit", "node_selector"),
    [
        ({"gpus": 1}, {}, "1", None),
        (
            {"gpus": 4, "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
            {"tensorParallelSize": 4},
            "4",
            {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        ),
        (
            {"gpus": 8, "gpuProduct": "NVIDIA-A100-SXM4-80GB"},
            {"tensorParallelSize": 2},
            "8",
            {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        ),
        ({"gpus": 0, "cpu": "2", "memory": "4Gi"}, {"kind": "reference"}, None, None),
    ],
    ids=["1-gpu", "tp4-h100", "tp2-8-gpus", "cpu"],
)
def test_gpu_limits_and_node_selector(
    resources: dict[str, Any], engine: dict[str, Any], gpu_limit: str | None, node_selector: dict[str, str] | None
) -> None:
    dep = render_deployment(OWNER, spec(resources=resources, engine=engine), 2, SETTINGS)
    limits = container(dep).get("resources", {}).get("limits", {})
    assert limits.get("nvidia.com/gpu") == gpu_limit
    assert pod(dep).get("nodeSelector") == node_selector
    assert dep["spec"]["replicas"] == 2


def test_cpu_and_memory_are_requests_and_limits() -> None:
    dep = render_deployment(OWNER, spec(resources={"gpus": 1, "cpu": 8, "memory": "64Gi"}), 1, SETTINGS)
    assert container(dep)["resources"] == {
        "limits": {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"},
        "requests": {"cpu": "8", "memory": "64Gi"},
    }


def test_security_context_is_locked_down() -> None:
    dep = render_deployment(OWNER, spec(), 1, SETTINGS)
    assert container(dep)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod_ctx = pod(dep)["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] == 1000
    assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod(dep)["automountServiceAccountToken"] is False
    assert pod(dep)["enableServiceLinks"] is False


def test_launcher_entrypoint_ports_and_probes() -> None:
    dep = render_deployment(OWNER, spec(autoscaling={"coldStartSeconds": 200}), 1, SETTINGS)
    c = container(dep)
    assert c["command"] == ["kvfleet", "engine", "launch", "--spec", "/etc/kvfleet/spec.json"]
    assert c["image"] == SETTINGS.images["vllm"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "http": 8000,
        "launcher": 9400,
        "kv-events": 5557,
        "kv-replay": 5558,
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # 3 x 200 s = 600 s of startup budget, probed every 10 s: 60 failures allowed.
    assert startup_budget_s(spec(autoscaling={"coldStartSeconds": 200}), SETTINGS) == 600
    assert c["startupProbe"]["failureThreshold"] == 60
    assert dep["spec"]["progressDeadlineSeconds"] == 600 + 120


@pytest.mark.parametrize(
    ("cold_start_s", "budget_s"),
    [(10, 300), (60, 300), (200, 600), (1000, 3000), (7200, 7200)],
    ids=["floor", "floor-edge", "3x", "3x-large", "ceiling"],
)
def test_startup_budget_is_bounded(cold_start_s: float, budget_s: int) -> None:
    assert startup_budget_s(spec(autoscaling={"coldStartSeconds": cold_start_s}), SETTINGS) == budget_s


def test_no_autoscaling_uses_the_default_estimate() -> None:
    assert startup_budget_s(spec(replicas=1), SETTINGS) == 900  # 3 x the default 300 s


def test_prestop_and_grace_period_cover_the_drain() -> None:
    dep = render_deployment(OWNER, spec(), 1, SETTINGS)
    assert container(dep)["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    assert pod(dep)["terminationGracePeriodSeconds"] == termination_grace_s(spec(), SETTINGS) == 10 + 600
    # The launcher, PID 1, is told the same drain budget: it must not SIGKILL the engine earlier.
    env = {e["name"]: e.get("value") for e in container(dep)["env"]}
    assert env["KVFLEET_DRAIN_TIMEOUT_S"] == "600"
    longer = SETTINGS.model_copy(update={"drain_timeout_s": 1800})
    dep = render_deployment(OWNER, spec(), 1, longer)
    assert pod(dep)["terminationGracePeriodSeconds"] == 10 + 1800
    assert {e["name"]: e.get("value") for e in container(dep)["env"]}["KVFLEET_DRAIN_TIMEOUT_S"] == "1800"


def test_grace_period_follows_the_longest_request_the_spec_allows() -> None:
    # A long-context deployment whose requests may run an hour: its pods wait that long after the
    # preStop sleep, and the launcher lets the engine drain as long, whatever the operator's default.
    dep = render_deployment(OWNER, spec(engine={"kind": "vllm", "maxRequestSeconds": 3600}), 1, SETTINGS)
    assert pod(dep)["terminationGracePeriodSeconds"] == 10 + 3600
    assert {e["name"]: e.get("value") for e in container(dep)["env"]}["KVFLEET_DRAIN_TIMEOUT_S"] == "3600"
    assert container(dep)["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    short = render_deployment(OWNER, spec(engine={"kind": "vllm", "maxRequestSeconds": 30}), 1, SETTINGS)
    assert pod(short)["terminationGracePeriodSeconds"] == 10 + 30


def test_volumes_shm_node_cache_spec_and_pin() -> None:
    s = spec(
        resources={"gpus": 1, "shmSize": "16Gi"},
        cache={"nodeCache": {"type": "hostPath", "hostPath": "/var/lib/kvfleet/models"}},
    )
    dep = render_deployment(OWNER, s, 1, SETTINGS)
    volumes = {v["name"]: v for v in pod(dep)["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["node-cache"]["hostPath"] == {"path": "/var/lib/kvfleet/models", "type": "Directory"}
    assert volumes["spec"]["configMap"]["name"] == "m-engine-spec"
    assert volumes["pin"]["configMap"] == {
        "name": "m-engine-pin",
        "items": [{"key": "modelDigest", "path": "modelDigest"}],
    }
    mounts = {m["name"]: m["mountPath"] for m in container(dep)["volumeMounts"]}
    assert mounts == {
        "spec": "/etc/kvfleet",
        "pin": "/etc/kvfleet-pin",
        "dshm": "/dev/shm",
        "node-cache": "/var/cache/kvfleet",
    }


PLATFORM = OperatorSettings(
    policy=SpecPolicy(
        node_cache_host_paths=("/var/lib/kvfleet/models", "/var/lib/kvfleet/models/big", "/data/"),
        image_registries=("*",),
        priority_classes=(),
        toleration_keys=(),
    )
)


@pytest.mark.parametrize(
    ("namespace", "host_path", "settings", "volume_path", "sub_path"),
    [
        ("team-a", "/var/lib/kvfleet/models", PLATFORM, "/var/lib/kvfleet/models", "team-a"),
        # Asking for another namespace's directory lands below one's own.
        ("team-a", "/var/lib/kvfleet/models/team-b", PLATFORM, "/var/lib/kvfleet/models", "team-a/team-b"),
        # A namespace named like the cache's own folders cannot reach into another namespace's cache.
        ("models", "/var/lib/kvfleet/models/team-b/", PLATFORM, "/var/lib/kvfleet/models", "models/team-b"),
        # Nested allowed entries: the outermost root holds the namespace level.
        ("team-a", "/var/lib/kvfleet/models/big", PLATFORM, "/var/lib/kvfleet/models", "team-a/big"),
        ("team-a", "/data", PLATFORM, "/data", "team-a"),
        # "*" allows any directory; the namespace still gets its own folder below it.
        ("team-a", "/mnt/cache", SETTINGS, "/mnt/cache", "team-a"),
    ],
    ids=["root", "another-namespace", "namespace-named-models", "nested-roots", "trailing-slash-entry", "any"],
)
def test_a_hostpath_node_cache_is_mounted_per_namespace(
    namespace: str, host_path: str, settings: OperatorSettings, volume_path: str, sub_path: str
) -> None:
    s = spec(cache={"nodeCache": {"type": "hostPath", "hostPath": host_path}})
    dep = render_deployment(Owner("m", namespace, "uid-1"), s, 1, settings)
    volumes = {v["name"]: v for v in pod(dep)["volumes"]}
    assert volumes["node-cache"]["hostPath"] == {"path": volume_path, "type": "Directory"}
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "node-cache")
    assert mount == {"name": "node-cache", "mountPath": "/var/cache/kvfleet", "subPath": sub_path}


def test_an_emptydir_node_cache_needs_no_namespace_folder() -> None:
    dep = render_deployment(OWNER, spec(), 1, SETTINGS)
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "node-cache")
    assert "subPath" not in mount


def test_pvc_model_is_mounted_read_only() -> None:
    dep = render_deployment(OWNER, spec(model={"uri": "pvc://weights/llama"}), 1, SETTINGS)
    volumes = {v["name"]: v for v in pod(dep)["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert {"name": "model", "mountPath": "/mnt/kvfleet/pvc/weights", "readOnly": True} in container(dep)[
        "volumeMounts"
    ]


def test_secrets_only_by_reference() -> None:
    s = spec(
        cache={"bucket": "model-cache", "credentialsSecret": "s3-creds", "s3Endpoint": "http://minio:9000"},
        engine={"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]},
    )
    env = {e["name"]: e for e in container(render_deployment(OWNER, s, 1, SETTINGS))["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["AWS_ENDPOINT_URL"] == {"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"}
    assert "value" not in env["AWS_ACCESS_KEY_ID"]


def test_scheduling_tolerations_spread_priority() -> None:
    s = spec(
        scheduling={
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "inference-high",
            "nodeSelector": {"pool": "gpu"},
            "topologySpread": {"topologyKey": "topology.kubernetes.io/zone"},
        }
    )
    p = pod(render_deployment(OWNER, s, 1, SETTINGS))
    assert p["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert p["priorityClassName"] == "inference-high"
    assert p["nodeSelector"] == {"pool": "gpu"}
    assert p["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {
                "matchLabels": {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.io/deployment": "m"}
            },
        }
    ]


def test_labels_and_owner_reference_on_every_child() -> None:
    children = render_children(OWNER, spec(), 1, SETTINGS, service_monitor=True)
    assert [c["kind"] for c in children] == [
        "ConfigMap",
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        "ServiceMonitor",
    ]
    for child in children:
        assert child["metadata"]["labels"] == names.labels("m")
        ref = child["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceDeployment", "m", "uid-1", True)
    assert children[1]["metadata"]["name"] == "m-engine-pin"
    assert children[1]["data"] == {"modelDigest": "", "model": '{"revision":null,"uri":"s3://model-cache/models/m"}'}
    dep = children[3]
    assert dep["spec"]["selector"]["matchLabels"] == names.selector("m")
    assert dep["spec"]["template"]["metadata"]["labels"]["kvfleet.io/deployment"] == "m"
    service = children[2]
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": 8000,
        "launcher": 9400,
        "kv-events": 5557,
        "kv-replay": 5558,
    }
    assert children[4]["spec"]["maxUnavailable"] == 1
    assert [e["port"] for e in children[5]["spec"]["endpoints"]] == ["http", "launcher"]


def test_no_owner_reference_without_uid_and_no_service_monitor_unless_asked() -> None:
    children = render_children(Owner("m", "ns"), spec(), 1, SETTINGS, service_monitor=False)
    assert "ServiceMonitor" not in [c["kind"] for c in children]
    assert all("ownerReferences" not in c["metadata"] for c in children)


def test_spec_json_is_the_launcher_contract() -> None:
    doc = json.loads(spec_json(OWNER, spec(model={"uri": "s3://model-cache/m", "servedName": "org/m"})))
    assert doc["name"] == "m" and doc["namespace"] == "ns" and doc["servedName"] == "org/m"
    assert doc["spec"]["engine"]["enablePrefixCaching"] is True  # defaults filled, camelCase
    assert doc["spec"]["model"]["uri"] == "s3://model-cache/m"


@pytest.mark.parametrize(
    ("change", "rolls"),
    [
        ({"engine": {"maxModelLen": 4096}}, True),
        ({"resources": {"gpus": 2}}, True),
        ({"autoscaling": {"maxReplicas": 9}}, False),
        ({"routing": {"strategy": "least-load"}}, False),
        ({"routing": {"kvEvents": {"enabled": False}}}, True),  # --kv-events-config is an engine flag
    ],
    ids=["engine-flag", "gpus", "autoscaling-knob", "routing-knob", "kv-events"],
)
def test_pod_hash_changes_only_for_pod_relevant_fields(change: dict[str, Any], rolls: bool) -> None:
    assert (pod_spec_hash(spec(**change)) != pod_spec_hash(spec())) is rolls


def test_nothing_empty_is_rendered() -> None:
    # The API server drops empty maps and lists, which the drift check would see as a change forever.
    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k != "emptyDir":
                    assert v not in ({}, [], None), f"{path}.{k} is empty"
                walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    for example in sorted(EXAMPLES.glob("*.yaml")):
        doc = yaml.safe_load(example.read_text())
        for child in render_children(
            OWNER, InferenceDeploymentSpec.model_validate(doc["spec"]), 1, SETTINGS, service_monitor=True
        ):
            walk(child, f"{example.name}:{child['kind']}")


def test_engine_image_from_spec_or_settings() -> None:
    assert container(render_deployment(OWNER, spec(engine={"image": "registry/own:1"}), 1, SETTINGS))["image"] == (
        "registry/own:1"
    )
    custom = OperatorSettings(images={"reference": "registry/cpu:2"})
    s = spec(engine={"kind": "reference"}, resources={"gpus": 0})
    assert container(render_deployment(OWNER, s, 1, custom))["image"] == "registry/cpu:2"


def test_engine_pods_get_public_artifact_keys_and_no_signing_key() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from kvfleet.operator.render import render_configmap
    from kvfleet.weight_cache.signing import public_pem

    private = Ed25519PrivateKey.generate()
    keys = public_pem(private.public_key())
    settings = OperatorSettings(artifact_public_keys=keys)
    s = spec(cache={"bucket": "model-cache", "credentialsSecret": "s3-read-only", "artifacts": {"enabled": True}})
    config = render_configmap(OWNER, s, settings)
    assert config["data"][names.ARTIFACT_KEYS_FILE] == keys
    dep = render_deployment(OWNER, s, 1, settings)
    volumes = {v["name"]: v for v in pod(dep)["volumes"]}
    assert volumes["spec"]["configMap"]["items"] == [
        {"key": "spec.json", "path": "spec.json"},
        {"key": "artifact-keys.pem", "path": "artifact-keys.pem"},
    ]
    # Checked artifacts are unpacked in the pod's own emptyDir, not on the shared node cache.
    assert volumes["artifacts-work"] == {"name": "artifacts-work", "emptyDir": {}}
    env = {e["name"]: e for e in container(dep)["env"]}
    assert env["KVFLEET_ARTIFACTS_WORK"]["value"] == "/var/lib/kvfleet/artifacts-work"
    # The only Secret the pod reads is the read credentials it was given, and only the two keys.
    secret_refs = [e["valueFrom"]["secretKeyRef"] for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
    assert secret_refs == [
        {"name": "s3-read-only", "key": "AWS_ACCESS_KEY_ID"},
        {"name": "s3-read-only", "key": "AWS_SECRET_ACCESS_KEY"},
    ]
    assert not [v for v in volumes.values() if "secret" in v or "projected" in v]
    text = json.dumps(render_children(OWNER, s, 1, settings, service_monitor=True))
    assert "PRIVATE KEY" not in text and "SIGNING" not in text
    # No keys configured: nothing to trust, so no artifact is ever loaded (the launcher's default).
    bare = render_configmap(OWNER, s, SETTINGS)
    assert set(bare["data"]) == {"spec.json"}
    # A private key handed to the operator by mistake is refused, naming why.
    from cryptography.hazmat.primitives import serialization

    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    with pytest.raises(ValueError, match="holds a private key; engine pods get public keys only"):
        OperatorSettings(artifact_public_keys=pem + keys)
    with pytest.raises(ValueError, match="no PEM public key"):
        OperatorSettings(artifact_public_keys="not a key")


@pytest.mark.parametrize(
    ("fields", "published"),
    [
        ({}, True),  # vllm with prefix caching: on by default
        ({"engine": {"kind": "reference"}, "resources": {"gpus": 0}}, True),
        ({"routing": {"kvEvents": {"enabled": False}}}, False),
        ({"engine": {"enablePrefixCaching": False}}, False),
        ({"engine": {"kind": "sglang"}}, False),  # no vLLM-format publisher
    ],
)
def test_kv_events_port_only_where_the_engine_publishes(fields: dict[str, Any], published: bool) -> None:
    children = render_children(OWNER, spec(**fields), 1, SETTINGS, service_monitor=False)
    service = next(c for c in children if c["kind"] == "Service")
    dep = next(c for c in children if c["kind"] == "Deployment")
    wanted = [{"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"}] if published else []
    # The Service's port names reach its EndpointSlices, where the routers find the events port.
    assert [p for p in service["spec"]["ports"] if p["name"] == names.KV_EVENTS_PORT] == wanted
    in_pod = [p for p in container(dep)["ports"] if p["name"] in (names.KV_EVENTS_PORT, names.KV_EVENTS_REPLAY_PORT)]
    assert in_pod == (
        [
            {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"},
        ]
        if published
        else []
    )


def test_operator_and_router_agree_on_the_events_port_name() -> None:
    from kvfleet.router.kubernetes_source import KV_EVENTS_PORT_NAME

    assert names.KV_EVENTS_PORT == KV_EVENTS_PORT_NAME


def test_operator_ports_must_differ_including_the_events_replay() -> None:
    with pytest.raises(ValueError, match=r"kv_events_port \+ 1 \(the events' replay\) must differ"):
        OperatorSettings(kv_events_port=7999)  # its replay socket would take the engine's 8000
    with pytest.raises(ValueError, match="kv_events_port"):
        OperatorSettings(kv_events_port=65535)
    assert OperatorSettings(kv_events_port=6000).kv_events_port == 6000
