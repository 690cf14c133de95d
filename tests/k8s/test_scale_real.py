"""The operator's behaviour that bench/scale.py measures at 1,000 deployments, asserted at a few on the
real API server: a converged fleet's resyncs send no request beyond watches (children and pods come
from the operator's watches, operator/child_cache.py); invalid specs among valid ones get their
condition and Event; a deployment asking for more GPUs than the cluster has says why it is not
Ready; a namespace deleted with its deployments is cleaned up; status follows a rollout at the engine
Deployment's pace (its watch), not at the rollout check's."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from support.real_cluster import ComponentProcess, Kubectl, audit_entries, condition, wait_for

from kvfleet.devcluster.controlplane import ControlPlane
from kvfleet_testkit.manifests import SCALE_POLICY
from kvfleet_testkit.manifests import inference_deployment as deployment

StartOperator = Callable[..., ComponentProcess]
RESYNC_S = 1.0  # resyncs every second, so a short window holds several of each deployment's


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
    policy.write_text(yaml.safe_dump(SCALE_POLICY))
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


def rolled(obj: dict[str, Any] | None, generation: int) -> bool:
    """Rolled and Ready as `kubectl rollout status` would say of the engine Deployment: every replica
    current and ready, for this generation of the spec."""
    status = (obj or {}).get("status") or {}
    return (
        ready(obj)
        and (condition(obj, "Progressing") or {}).get("reason") == "Complete"
        and status.get("observedGeneration") == generation == (obj or {})["metadata"]["generation"]
        and status.get("readyReplicas") == (obj or {})["spec"]["replicas"]
    )


def test_status_follows_a_rollout_at_the_deployments_pace(
    control_plane: ControlPlane, kubectl: Kubectl, namespace: str, start_operator: StartOperator
) -> None:
    # Timers far beyond the test's waits: only the engine Deployment's watch (operator/rollout_nudge.py)
    # can bring status up to date in time. Without it Ready waits for the rollout check.
    slow_s = 600
    start_operator("--resync-interval-s", str(slow_s), "--rollout-check-interval-s", str(slow_s))
    kubectl.apply(deployment("roll", namespace, replicas=2), "--server-side")
    wait_for(lambda: rolled(kubectl.get("infd", "roll", namespace), 1), 60, "Ready, 2/2 current")
    # A spec change rolls new pods: status says Complete once the Deployment controller has rolled them.
    kubectl("patch", "infd", "roll", "-n", namespace, "--type=merge", "-p", '{"spec":{"engine":{"maxModelLen":4096}}}')
    wait_for(lambda: rolled(kubectl.get("infd", "roll", namespace), 2), 60, "rolled and Ready, 2/2 current")
    engine = kubectl.json("get", "deployment", "roll-engine", "-n", namespace)
    status = engine["status"]
    assert status.get("observedGeneration") == engine["metadata"]["generation"]
    assert status.get("updatedReplicas") == status.get("readyReplicas") == 2
