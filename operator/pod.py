"""The engine pod template: a pure function of the spec and the operator settings.

Nothing here emits an empty map or list or a None: the API server drops those, and the drift
check would then see a difference on every resync and write forever.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from kvfleet.spec import EnvVar, InferenceDeploymentSpec

from . import names
from .policy import host_path_root
from .settings import OperatorSettings

PVC_MOUNT_ROOT = "/mnt/kvfleet/pvc"
CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def cold_start_estimate_s(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> float:
    """The spec's estimate (autoscaling.coldStartSeconds), else the operator's default.

    The measured figure in status is deliberately not used: feeding it back into the pod template
    would roll every pod each time a new measurement arrives.
    """
    if spec.autoscaling is not None:
        return spec.autoscaling.cold_start_seconds
    return settings.default_cold_start_s


def startup_budget_s(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> int:
    """How long the startup probe lets a pod pull weights and load before the kubelet restarts it."""
    budget = math.ceil(settings.startup_budget_factor * cold_start_estimate_s(spec, settings))
    return max(settings.startup_budget_min_s, min(settings.startup_budget_max_s, budget))


def drain_budget_s(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> int:
    """How long a stopping engine finishes in-flight requests: the longest request the spec allows."""
    return spec.engine.max_request_seconds or settings.drain_timeout_s


def termination_grace_s(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> int:
    """preStop sleep plus the time the engine may take to finish in-flight requests after SIGTERM."""
    return settings.prestop_delay_s + drain_budget_s(spec, settings)


def pod_spec_hash(spec: InferenceDeploymentSpec) -> str:
    """Hash of the spec parts a pod is built from; a change rolls the pods.

    autoscaling, routing and replicas are left out: they change the ConfigMap (the launcher reads
    the whole spec) but nothing a running engine uses, so they must not restart GPU pods. Whether
    the engine publishes KV-cache events (routing.kvEvents) is an engine flag, so it counts.
    """
    wire = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    relevant = {k: v for k, v in wire.items() if k not in {"autoscaling", "routing", "replicas"}}
    relevant["publishesKvEvents"] = spec.publishes_kv_events
    blob = json.dumps(relevant, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _env_var(var: EnvVar) -> dict[str, Any]:
    if var.value_from is None:
        return {"name": var.name, "value": var.value or ""}
    source = var.value_from
    if source.secret_key_ref is not None:
        ref = source.secret_key_ref
        return {"name": var.name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
    assert source.config_map_key_ref is not None  # EnvVarSource validates exactly one
    ref = source.config_map_key_ref
    return {"name": var.name, "valueFrom": {"configMapKeyRef": {"name": ref.name, "key": ref.key}}}


def _env(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "KVFLEET_NODE_CACHE", "value": names.NODE_CACHE_MOUNT},
        {"name": "KVFLEET_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # The launcher (PID 1) waits this long for the engine's drain after SIGTERM before killing it:
        # the same budget terminationGracePeriodSeconds gives after the preStop sleep.
        {"name": "KVFLEET_DRAIN_TIMEOUT_S", "value": str(drain_budget_s(spec, settings))},
    ]
    cache = spec.cache
    if cache.s3_endpoint is not None:
        env.append({"name": "AWS_ENDPOINT_URL", "value": cache.s3_endpoint})
    if cache.region is not None:
        env.append({"name": "AWS_REGION", "value": cache.region})
    if cache.credentials_secret is not None:
        # By reference only: the operator never reads the Secret, so it needs no RBAC on Secrets.
        for key in CREDENTIAL_KEYS:
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": cache.credentials_secret, "key": key}}})
    if cache.artifacts.enabled:
        env.append({"name": "KVFLEET_ARTIFACTS_WORK", "value": names.ARTIFACTS_WORK_MOUNT})
    # Never a signing key (KVFLEET_ARTIFACT_SIGNING_KEY) or write credentials of the platform's:
    # engine pods only verify artifacts, against the public keys beside spec.json.
    env.extend(_env_var(v) for v in spec.engine.env)
    return env


def _resources(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    res = spec.resources
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if res.gpus:
        limits["nvidia.com/gpu"] = str(res.gpus)
    for key, value in (("cpu", res.cpu), ("memory", res.memory)):
        if value is not None:
            limits[key] = value
            requests[key] = value
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def node_cache_host_volume(namespace: str, host_path: str, settings: OperatorSettings) -> tuple[str, str]:
    """(hostPath volume path, subPath of the mount) of a hostPath node cache: the platform's allowed
    root, and ``<namespace>`` below it (then the rest of the spec's path). A pod sees its own
    namespace's directory only, so a co-tenant can neither read nor plant files in it: a spec's
    ``hostPath`` cannot name another namespace's directory, since the namespace always comes first
    under the root (``<root>/b`` asked from namespace ``a`` is ``<root>/a/b``)."""
    root = host_path_root(host_path, settings.policy)
    rest = host_path.rstrip("/")[len(root.rstrip("/")) :].strip("/")
    return root, f"{namespace}/{rest}" if rest else namespace


def _volumes(
    name: str, namespace: str, spec: InferenceDeploymentSpec, settings: OperatorSettings
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    items = [{"key": names.SPEC_FILE, "path": names.SPEC_FILE}]
    artifacts = spec.cache.artifacts.enabled
    if artifacts and settings.artifact_public_keys is not None:
        items.append({"key": names.ARTIFACT_KEYS_FILE, "path": names.ARTIFACT_KEYS_FILE})
    volumes: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": names.spec_configmap_name(name), "items": items}},
        {
            # The model digest the deployment pinned (empty until the first pod served one). A
            # ConfigMap volume follows the ConfigMap's changes without a new pod template, so
            # pinning rolls no pod; the launcher reads it at each start.
            "name": "pin",
            "configMap": {
                "name": names.pin_configmap_name(name),
                "items": [{"key": names.PIN_KEY, "path": names.PIN_KEY}],
            },
        },
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "spec", "mountPath": names.SPEC_MOUNT_DIR, "readOnly": True},
        {"name": "pin", "mountPath": names.PIN_MOUNT_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": names.SHM_MOUNT},
    ]
    node_cache = spec.cache.node_cache
    if node_cache.type == "hostPath":
        # type Directory, not DirectoryOrCreate: the kubelet would create it owned by root and the
        # non-root engine could not write to it; a missing directory fails visibly at mount instead.
        # The namespace's directory below it is the mount's subPath, which the kubelet creates with
        # the root's mode (docs/chart.md: a setgid, group-writable root keeps it writable).
        assert node_cache.host_path is not None  # NodeCacheSpec validates it
        root, sub_path = node_cache_host_volume(namespace, node_cache.host_path, settings)
        volumes.append({"name": "node-cache", "hostPath": {"path": root, "type": "Directory"}})
        mounts.append({"name": "node-cache", "mountPath": names.NODE_CACHE_MOUNT, "subPath": sub_path})
    else:
        empty: dict[str, Any] = {}
        if node_cache.size_limit is not None:
            empty["sizeLimit"] = node_cache.size_limit
        volumes.append({"name": "node-cache", "emptyDir": empty})
        mounts.append({"name": "node-cache", "mountPath": names.NODE_CACHE_MOUNT})
    if artifacts:
        # The launcher unpacks checked artifacts here, not on the node cache a co-tenant may share.
        volumes.append({"name": "artifacts-work", "emptyDir": {}})
        mounts.append({"name": "artifacts-work", "mountPath": names.ARTIFACTS_WORK_MOUNT})
    if spec.model.uri.startswith("pvc://"):
        claim = spec.model.uri[len("pvc://") :].split("/", 1)[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": f"{PVC_MOUNT_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


def _probe(settings: OperatorSettings, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": names.HTTP_PORT},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _scheduling(name: str, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    sched = spec.scheduling
    out: dict[str, Any] = {}
    node_selector = dict(sched.node_selector)
    if spec.resources.gpu_product is not None:
        # The typed field wins over a same-key entry in nodeSelector.
        node_selector["nvidia.com/gpu.product"] = spec.resources.gpu_product
    if node_selector:
        out["nodeSelector"] = dict(sorted(node_selector.items()))
    if sched.tolerations:
        out["tolerations"] = [t.to_wire() for t in sched.tolerations]
    if sched.affinity:
        out["affinity"] = sched.affinity
    if sched.priority_class_name is not None:
        out["priorityClassName"] = sched.priority_class_name
    if sched.topology_spread is not None:
        spread = sched.topology_spread
        out["topologySpreadConstraints"] = [
            {
                "maxSkew": spread.max_skew,
                "topologyKey": spread.topology_key,
                "whenUnsatisfiable": spread.when_unsatisfiable,
                "labelSelector": {"matchLabels": names.selector(name)},
            }
        ]
    return out


def engine_ports(spec: InferenceDeploymentSpec, settings: OperatorSettings, key: str) -> list[dict[str, Any]]:
    """The engine pod's named ports (``key``: containerPort, or port for the Service); kv-events only
    when the engine publishes them, so a router finds the events port exactly where there are events."""
    ports = [(names.HTTP_PORT, settings.engine_port), (names.LAUNCHER_PORT, settings.launcher_port)]
    if spec.publishes_kv_events:
        ports.append((names.KV_EVENTS_PORT, settings.kv_events_port))
        ports.append((names.KV_EVENTS_REPLAY_PORT, names.kv_events_replay_port(settings.kv_events_port)))
    if key == "containerPort":
        return [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports]
    return [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports]


def render_pod_template(
    name: str, namespace: str, spec: InferenceDeploymentSpec, settings: OperatorSettings
) -> dict[str, Any]:
    """The Deployment's ``spec.template``."""
    volumes, mounts = _volumes(name, namespace, spec, settings)
    period = settings.probe_period_s
    startup_failures = math.ceil(startup_budget_s(spec, settings) / period)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine.image or settings.image_for(spec.engine.kind),
        "imagePullPolicy": settings.image_pull_policy,
        # The launcher pulls weights, restores artifacts, then execs the engine (docs/contracts.md).
        "command": ["kvfleet", "engine", "launch", "--spec", f"{names.SPEC_MOUNT_DIR}/{names.SPEC_FILE}"],
        "ports": engine_ports(spec, settings, "containerPort"),
        "env": _env(spec, settings),
        "volumeMounts": mounts,
        "startupProbe": _probe(settings, period, startup_failures),
        # Readiness reacts fast: a draining engine answers 503 and must leave the endpoints quickly.
        "readinessProbe": _probe(settings, 5, 2),
        "livenessProbe": _probe(settings, period, settings.liveness_failure_threshold),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(settings.prestop_delay_s)]}}},
        # The launcher writes why it failed to /dev/termination-log; without it, the log's tail is
        # the message. Either reaches the pod status, and from there the Degraded condition.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # The engine needs no Kubernetes API access; a token in the pod would only be a risk.
        "automountServiceAccountToken": False,
        # Service links inject <SVC>_PORT variables; a Service called "vllm" sets VLLM_PORT, which
        # vLLM reads as its own setting and fails on.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_s(spec, settings),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **_scheduling(name, spec),
    }
    return {
        "metadata": {
            "labels": names.labels(name),
            "annotations": {names.SPEC_HASH_ANNOTATION: pod_spec_hash(spec)},
        },
        "spec": pod_spec,
    }
