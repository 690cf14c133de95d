"""The operator's behaviour that bench/scale.py measures at 1,000 deployments, asserted at a few on the
real API server: a converged fleet's resyncs send no request beyond watches (children and pods come
from the operator's watches, operator/child_cache.py); invalid specs among valid ones get their
condition and Event; a deployment asking for more GPUs than the cluster has says why it is not
Ready; a namespace deleted with its deployments is cleaned up."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from support.real_cluster import ComponentProcess, Kubectl, audit_entries, condition, wait_for

from kvfleet.devcluster.controlplane import ControlPlane

StartOperator = Callable[..., ComponentProcess]
POLICY = {"nodeCacheHostPaths": [], "imageRegistries": ["ghcr.io/kvfleet"], "priorityClasses": ["*"]}
POLICY["tolerationKeys"] = ["*"]
RESYNC_S = 1.0  # resyncs every second, so a short window holds several of each deployment's


def deployment(name: str, namespace: str, *, replicas: int = 1, gpus: int = 1, invalid: bool = False) -> dict:
    # Admitted by the API server (the CRD cannot know the platform's registries), refused by the
    # operator's spec policy: Degraded=PolicyViolation and an Event.
    engine: dict[str, Any] = {"kind": "vllm", **({"image": "registry.example/unvetted/engine:1"} if invalid else {})}
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": f"s3://model-cache/models/{name}"},
            "engine": engine,
            "resources": {"gpus": gpus},
            "replicas": replicas,
            "cache": {"bucket": "model-cache"},
        },
    }


def ready(obj: dict[str, Any] | None) -> bool:
    return (condition(obj, "Ready") or {}).get("status") == "True"


def operator_requests(root: Path, since: str) -> list[str]:
    """What the operator's own client and kopf sent since ``since``, watches left out."""
    return [
        f"{e['verb']} {e.get('requestURI', '')[:120]}"
        for e in audit_entries(root)
        if e.get("requestReceivedTimestamp", "") >= since
        and (e.get("userAgent", "").startswith("kvfleet-operator") or e.get("userAgent", "").startswith("kopf"))
        and e.get("verb") != "watch"
    ]


def test_a_converged_fleet_costs_no_requests_and_bad_input_is_reported(
    control_plane: ControlPlane, kubectl: Kubectl, start_operator: StartOperator, tmp_path: Path
) -> None:
    # A namespace of its own, not the ``namespace`` fixture's: this test deletes it.
    namespace = f"scale-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", namespace)
    wait_for(lambda: kubectl.get("serviceaccount", "default", namespace), 30, "the default ServiceAccount")
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    start_operator("--resync-interval-s", str(RESYNC_S), "--policy-file", str(policy))
    good = [deployment(f"m{i}", namespace) for i in range(3)]
    bad = deployment("bad", namespace, invalid=True)
    kubectl.apply([*good, bad], "--server-side")
    for doc in good:
        wait_for(lambda d=doc: ready(kubectl.get("infd", d["metadata"]["name"], namespace)), 90, "Ready")
    degraded = wait_for(
        lambda: (
            (condition(kubectl.get("infd", "bad", namespace), "Degraded") or {}).get("reason") == "PolicyViolation"
            and kubectl.get("infd", "bad", namespace)
        ),
        60,
        "Degraded=PolicyViolation",
    )
    assert "spec.engine.image" in condition(degraded, "Degraded")["message"]
    events = kubectl.json("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=bad")["items"]
    assert any(e["reason"] == "PolicyViolation" for e in events)

    # Steady state: several resyncs of every deployment, and not one request (watches aside).
    time.sleep(3)  # the last status writes and Events of convergence
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    time.sleep(5 * RESYNC_S + 1)
    sent = operator_requests(Path(control_plane.settings.root), since)
    assert sent == [], sent

    # More GPUs than the cluster's 3 nodes x 8 have: what fits runs, status says why the rest does not.
    kubectl.apply(deployment("huge", namespace, replicas=4, gpus=8), "--server-side")
    huge = wait_for(
        lambda: (
            (o := kubectl.get("infd", "huge", namespace))
            and "Unschedulable" in str((o.get("status") or {}).get("conditions"))
            and o
        ),
        90,
        "status naming the unschedulable pods",
    )
    assert (huge["status"].get("readyReplicas") or 0) < 4

    # The namespace deleted with its deployments: the operator lets each go, and the namespace goes.
    kubectl("delete", "namespace", namespace, "--wait=false")
    wait_for(lambda: kubectl.get("namespace", namespace) is None, 120, f"namespace {namespace} to be gone")
