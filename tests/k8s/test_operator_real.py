"""The real kopf operator (`kvfleet operator run`, a process of its own) against a real API server:
every example reconciled into owned children whose pods land on kwok GPU nodes and become Ready;
server-side apply shared with users and Argo CD; the scale subresource and the autoscaler's status
decision; restarts and leadership."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.real_cluster import ComponentProcess, Kubectl, condition, wait_for

from kvfleet.autoscaler.actuators import KubernetesActuator, ScaleCommand
from kvfleet.autoscaler.sources import Target
from kvfleet.devcluster.controlplane import ControlPlane
from kvfleet.devcluster.nodes import GPU_PRODUCT_LABEL, GPU_RESOURCE
from kvfleet.kube.client import KubeClient
from kvfleet.operator.rbac import render_peering
from kvfleet.operator.settings import FIELD_MANAGER, FINALIZER

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CHILD_KINDS = ("deployment", "service", "configmap", "poddisruptionbudget")
# Each child once, but two ConfigMaps: the launcher's spec and the pinned model digest.
CHILD_COUNTS = {"deployment": 1, "service": 1, "configmap": 2, "poddisruptionbudget": 1}
StartOperator = Callable[..., ComponentProcess]


@pytest.fixture(scope="module")
def priority_class(kubectl: Kubectl) -> None:
    """The examples ask for PriorityClass inference-high (a real server refuses pods without it)."""
    if kubectl.get("priorityclass", "inference-high") is None:
        kubectl("create", "priorityclass", "inference-high", "--value=1000")


def example(path: Path, namespace: str) -> dict[str, Any]:
    doc = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "InferenceDeployment")
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = namespace
    return dict(doc)


def children(kubectl: Kubectl, namespace: str, name: str) -> dict[str, list[dict[str, Any]]]:
    found = {}
    for kind in CHILD_KINDS:
        items = kubectl.json("get", kind, "-n", namespace, "-l", f"kvfleet.io/deployment={name}")["items"]
        found[kind] = items
    return found


def pods(kubectl: Kubectl, namespace: str, name: str) -> list[dict[str, Any]]:
    return list(kubectl.json("get", "pods", "-n", namespace, "-l", f"kvfleet.io/deployment={name}")["items"])


def ready_pods(kubectl: Kubectl, namespace: str, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in pods(kubectl, namespace, name)
        if not p["metadata"].get("deletionTimestamp")
        and condition(p, "Ready")
        and condition(p, "Ready")["status"] == "True"  # type: ignore[index]
    ]


def scale_decision(kubeconfig: Path, namespace: str, name: str, replicas: int) -> None:
    """Write status.desiredReplicas the way the autoscaler does (its own actuator and client)."""

    async def write() -> None:
        async with KubeClient.from_kubeconfig(str(kubeconfig)) as api:
            command = ScaleCommand(replicas, f"TestDecision: {replicas}", datetime.now(UTC))
            await KubernetesActuator(api).apply(Target(namespace=namespace, name=name, served_name=name), command)

    asyncio.run(write())


def infd(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    return kubectl.get("infd", name, namespace)


def cond_status(obj: dict[str, Any] | None, type_: str) -> str | None:
    found = condition(obj, type_)
    return found["status"] if found else None


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_reconcile_to_ready_pods_on_gpu_nodes_and_are_collected(
    kubectl: Kubectl,
    control_plane: ControlPlane,
    start_operator: StartOperator,
    priority_class: None,
    namespace: str,
    path: Path,
) -> None:
    start_operator()
    doc = example(path, namespace)
    name = doc["metadata"]["name"]
    # Watched from before the apply: the operator follows the rollout from its watch, so Progressing
    # can last less than any polling interval on kwok's fast pods.
    history = kubectl.watch("infd", namespace)
    kubectl.apply(doc, "--server-side", "--field-manager=platform-team")
    owner = wait_for(lambda: infd(kubectl, namespace, name), 10, "the InferenceDeployment")

    found = wait_for(
        lambda: (lambda c: c if all(c.values()) else None)(children(kubectl, namespace, name)), 30, "every child"
    )
    for kind, items in found.items():
        assert len(items) == CHILD_COUNTS[kind], f"{kind}: {len(items)} objects"
        for item in items:
            meta = item["metadata"]
            refs = meta["ownerReferences"]
            assert refs == [
                {
                    "apiVersion": "kvfleet.io/v1alpha1",
                    "kind": "InferenceDeployment",
                    "name": name,
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ], kind
            managers = {(m["manager"], m["operation"]) for m in meta["managedFields"]}
            assert (FIELD_MANAGER, "Apply") in managers, f"{kind} managers: {managers}"

    spec = doc["spec"]
    autoscaling = spec.get("autoscaling") or {}
    if autoscaling.get("minReplicas", 1) == 0:
        wait_for(lambda: cond_status(infd(kubectl, namespace, name), "ScaledToZero") == "True", 30, "ScaledToZero")
        scale_decision(control_plane.kubeconfig, namespace, name, 1)
    want = max(1, autoscaling.get("minReplicas", 1))

    # Progressing while the pods start, then Ready: every version the API server held, in order.
    def ready() -> bool:
        obj = infd(kubectl, namespace, name)
        return cond_status(obj, "Ready") == "True" and (obj or {}).get("status", {}).get("readyReplicas") == want

    with history:
        wait_for(ready, 60, f"{name} Ready", interval_s=0.1)
        wait_for(lambda: any(cond_status(o, "Ready") == "True" for o in history.objects()), 10, "the watch")
        versions = history.objects()
    seen = [(cond_status(o, "Progressing"), cond_status(o, "Ready")) for o in versions]
    ready_at = [i for i, pair in enumerate(seen) if pair == ("False", "True")]
    if autoscaling.get("minReplicas", 1) == 0:
        # Ready at zero is right; what must come before the last Ready is the scale-up's Progressing.
        decided = next(i for i, o in enumerate(versions) if o.get("status", {}).get("desiredReplicas") == want)
        before_ready = seen[decided : ready_at[-1]]
    else:
        before_ready = seen[: ready_at[0]]
    assert ("True", "False") in before_ready, f"never seen Progressing before Ready: {seen}"
    final = infd(kubectl, namespace, name)
    assert final is not None
    assert final["status"]["readyReplicas"] == want
    assert cond_status(final, "Progressing") == "False"

    running = ready_pods(kubectl, namespace, name)
    assert len(running) == want
    gpus = (spec.get("resources") or {}).get("gpus", 1)
    for pod in running:
        assert pod["spec"]["nodeName"].startswith("kwok-gpu-")
        assert pod["status"].get("podIP"), "kwok gives every pod an IP"
        container = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        if gpus:
            assert container["resources"]["limits"][GPU_RESOURCE] == str(gpus)
        product = (spec.get("resources") or {}).get("gpuProduct")
        if product:
            assert pod["spec"]["nodeSelector"][GPU_PRODUCT_LABEL] == product
            node = kubectl.json("get", "node", pod["spec"]["nodeName"])
            assert node["metadata"]["labels"][GPU_PRODUCT_LABEL] == product

    kubectl("delete", "infd", name, "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        lambda: not any(children(kubectl, namespace, name).values()) and not pods(kubectl, namespace, name),
        60,
        "children and pods collected",
    )


def tiny_spec(namespace: str, name: str = "ssa", **autoscaling: Any) -> dict[str, Any]:
    doc = example(REPO / "examples" / "tiny.yaml", namespace)
    doc["metadata"]["name"] = name
    doc["metadata"].pop("annotations", None)
    if autoscaling:
        doc["spec"]["autoscaling"].update(autoscaling)
    if doc["spec"]["autoscaling"]["minReplicas"] > 0:
        doc["spec"]["autoscaling"].pop("scaleToZeroAfterSeconds", None)
    return doc


def operator_writes(kubectl: Kubectl, namespace: str, name: str) -> dict[str, tuple[object, ...]]:
    """Per child: its generation (moves on spec writes) and the time of the operator's own apply in
    managedFields (moves whenever an operator apply changed anything). Not the resourceVersion: the
    Deployment and PDB controllers write their status on their own schedule, which is no fight."""
    return {
        f"{kind}/{item['metadata']['name']}": (
            item["metadata"].get("generation"),
            *sorted(
                m.get("time", "")
                for m in item["metadata"].get("managedFields", [])
                if m["manager"] == FIELD_MANAGER and m.get("subresource") is None
            ),
        )
        for kind, items in children(kubectl, namespace, name).items()
        for item in items
    }


def test_server_side_apply_users_operator_and_gitops_never_fight(
    kubectl: Kubectl, start_operator: StartOperator, namespace: str
) -> None:
    start_operator()
    doc = tiny_spec(namespace, minReplicas=1)
    kubectl.apply(doc, "--server-side", "--field-manager=alice")
    wait_for(lambda: cond_status(infd(kubectl, namespace, "ssa"), "Ready") == "True", 60, "Ready")
    before = infd(kubectl, namespace, "ssa")
    assert before is not None
    children_before = operator_writes(kubectl, namespace, "ssa")
    assert len(children_before) == sum(CHILD_COUNTS.values())

    # The same manifests again (what Argo CD does on every sync): nothing changes anywhere.
    out = kubectl.apply(doc, "--server-side", "--field-manager=alice")
    assert "serverside-applied" in out
    time.sleep(7)  # two resyncs of the operator (3 s) and a reconcile of the re-apply
    after = infd(kubectl, namespace, "ssa")
    assert after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert operator_writes(kubectl, namespace, "ssa") == children_before

    # A second user's conflicting value is refused and named, not silently taken.
    rival = copy.deepcopy(doc)
    rival["spec"]["autoscaling"]["maxReplicas"] = 2
    result = kubectl.run("apply", "--server-side", "--field-manager=bob", "-f", "-", stdin=yaml.safe_dump(rival))
    assert result.returncode != 0
    assert "conflict" in result.stderr.lower() and "alice" in result.stderr, result.stderr
    current = infd(kubectl, namespace, "ssa")
    assert current is not None
    assert current["spec"]["autoscaling"]["maxReplicas"] == doc["spec"]["autoscaling"]["maxReplicas"]

    # Who owns what: alice the spec, the operator status only: no finalizer, no annotation of kopf's.
    assert not current["metadata"].get("finalizers")
    assert not [a for a in current["metadata"].get("annotations") or {} if a.startswith("kvfleet.io/")]
    managed = current["metadata"]["managedFields"]
    spec_owners = {m["manager"] for m in managed if "f:spec" in m.get("fieldsV1", {})}
    assert spec_owners == {"alice"}, spec_owners
    status_owners = {m["manager"] for m in managed if m.get("subresource") == "status"}
    assert FIELD_MANAGER in status_owners, status_owners


def test_kubectl_scale_through_the_scale_subresource(
    kubectl: Kubectl, start_operator: StartOperator, namespace: str
) -> None:
    start_operator()
    doc = tiny_spec(namespace, name="fixed")
    del doc["spec"]["autoscaling"]
    doc["spec"]["replicas"] = 1
    kubectl.apply(doc, "--server-side", "--field-manager=alice")
    wait_for(lambda: len(ready_pods(kubectl, namespace, "fixed")) == 1, 60, "1 pod Ready")
    kubectl("scale", "infd/fixed", "-n", namespace, "--replicas=3")
    wait_for(lambda: len(ready_pods(kubectl, namespace, "fixed")) == 3, 60, "3 pods Ready")
    scale = kubectl.json("get", "infd", "fixed", "-n", namespace, "--subresource=scale")
    assert scale["spec"]["replicas"] == 3
    wait_for(
        lambda: (
            kubectl.json("get", "infd", "fixed", "-n", namespace, "--subresource=scale")["status"].get("replicas") == 3
        ),
        30,
        "status.replicas 3 through the scale subresource",
    )
    deployment = kubectl.json("get", "deployment", "fixed-engine", "-n", namespace)
    assert deployment["spec"]["replicas"] == 3


def test_an_older_operators_finalizer_is_removed_and_a_delete_goes_at_once(
    kubectl: Kubectl, start_operator: StartOperator, namespace: str
) -> None:
    """The operator adds no finalizer; one an older version added is removed on sight (kopf drops a
    finalizer that no handler needs; on the real API server its optimistic JSON patch meets the
    operator's own status writes, 422, and is tried again on the next event), so the delete is not
    held, and the garbage collector takes the children."""
    start_operator()
    doc = tiny_spec(namespace, name="legacy")
    doc["spec"]["model"]["servedName"] = "legacy"  # the other tests' "tiny" may still be held while they go
    doc["metadata"]["finalizers"] = [FINALIZER]
    kubectl.apply(doc, "--server-side", "--field-manager=alice")
    wait_for(lambda: cond_status(infd(kubectl, namespace, "legacy"), "Ready") is not None, 30, "status")
    wait_for(
        lambda: not ((infd(kubectl, namespace, "legacy") or {}).get("metadata") or {}).get("finalizers"),
        30,
        "the old finalizer removed",
    )
    wait_for(lambda: all(children(kubectl, namespace, "legacy").values()), 60, "the children")
    kubectl("delete", "infd", "legacy", "-n", namespace, "--wait=true", "--timeout=20s")
    wait_for(lambda: not any(children(kubectl, namespace, "legacy").values()), 60, "children collected")


def test_autoscaler_decision_drives_replicas_to_zero_and_back(
    kubectl: Kubectl, control_plane: ControlPlane, start_operator: StartOperator, namespace: str
) -> None:
    start_operator()
    kubectl.apply(tiny_spec(namespace, name="auto"), "--server-side", "--field-manager=alice")
    wait_for(lambda: cond_status(infd(kubectl, namespace, "auto"), "ScaledToZero") == "True", 30, "ScaledToZero")
    for replicas in (2, 0, 1):
        scale_decision(control_plane.kubeconfig, namespace, "auto", replicas)
        wait_for(lambda r=replicas: len(ready_pods(kubectl, namespace, "auto")) == r, 60, f"{replicas} pods Ready")
        wait_for(lambda r=replicas: len(pods(kubectl, namespace, "auto")) == r, 60, f"exactly {replicas} pods")
        obj = infd(kubectl, namespace, "auto")
        assert obj is not None
        assert kubectl.json("get", "deployment", "auto-engine", "-n", namespace)["spec"]["replicas"] == replicas
        expected = "True" if replicas == 0 else "False"
        wait_for(
            lambda e=expected: cond_status(infd(kubectl, namespace, "auto"), "ScaledToZero") == e,
            30,
            f"ScaledToZero={expected}",
        )


def test_killed_mid_reconcile_the_restarted_operator_converges_without_duplicates(
    kubectl: Kubectl, start_operator: StartOperator, namespace: str
) -> None:
    first = start_operator(name="first")
    wait_for(lambda: "Initial authentication has finished" in first.log(), 30, "the operator to log in")
    kubectl.apply(tiny_spec(namespace, name="crash", minReplicas=1), "--server-side", "--field-manager=alice")
    # kill -9 as soon as the first child exists: the rest of the reconcile has not happened.
    wait_for(lambda: any(children(kubectl, namespace, "crash").values()), 30, "a first child", interval_s=0.02)
    first.kill()
    partial = {k: len(v) for k, v in children(kubectl, namespace, "crash").items()}
    second = start_operator(name="second")
    wait_for(lambda: cond_status(infd(kubectl, namespace, "crash"), "Ready") == "True", 60, "Ready after restart")
    counts = {k: len(v) for k, v in children(kubectl, namespace, "crash").items()}
    assert counts == CHILD_COUNTS, f"before the kill {partial}, after {counts}"
    assert len(ready_pods(kubectl, namespace, "crash")) == 1
    if sum(partial.values()) < sum(CHILD_COUNTS.values()):  # killed between applies: the restart finished them
        assert "applied" in second.log()


def test_two_operators_only_the_leader_acts_and_the_other_takes_over(
    kubectl: Kubectl, start_operator: StartOperator, namespace: str
) -> None:
    crd, peering = render_peering()
    kubectl.apply(crd, "--server-side", "--field-manager=kvfleet-tests")
    kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=30s")
    wait_for(
        lambda: kubectl.run("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(peering)).returncode == 0,
        30,
        "the peering object",
    )
    low = start_operator(
        "--peering",
        "kvfleet",
        "--priority",
        "100",
        "--peering-lifetime-s",
        "10",
        "--router-endpoint",
        "http://low/v1",
        name="low",
    )
    high = start_operator(
        "--peering",
        "kvfleet",
        "--priority",
        "200",
        "--peering-lifetime-s",
        "10",
        "--router-endpoint",
        "http://high/v1",
        name="high",
    )
    # Both see each other through the peering object before any work arrives.
    wait_for(
        lambda: len((kubectl.get("clusterkopfpeering", "kvfleet") or {}).get("status") or {}) >= 2,
        60,
        "both operators in the peering object",
    )
    ha = tiny_spec(namespace, name="ha", minReplicas=1)
    # These operators watch every namespace: a served name of its own, so that another test's "tiny"
    # (older, and still being torn down) does not hold it (ServedNameConflict).
    ha["spec"]["model"]["servedName"] = f"ha-{namespace}"
    kubectl.apply(ha, "--server-side", "--field-manager=alice")

    def endpoint() -> str | None:
        return ((infd(kubectl, namespace, "ha") or {}).get("status") or {}).get("endpoint")

    wait_for(lambda: endpoint() == "http://high/v1", 60, "the leader's status")
    wait_for(lambda: cond_status(infd(kubectl, namespace, "ha"), "Ready") == "True", 60, "Ready")
    time.sleep(7)  # two resyncs: the paused one stays paused
    assert endpoint() == "http://high/v1"
    assert "applied" not in low.log(), "the paused operator wrote children"

    high.kill()
    # The survivor resumes once the dead peer's entry lapses, then reconciles the next change.
    kubectl("patch", "infd", "ha", "-n", namespace, "--type=merge", "-p", '{"spec":{"engine":{"maxModelLen":1024}}}')
    wait_for(lambda: endpoint() == "http://low/v1", 120, "the low-priority operator to take over")
    try:
        wait_for(lambda: "applied" in low.log(), 30, "the survivor to apply the change")
    except AssertionError as e:
        conditions = ((infd(kubectl, namespace, "ha") or {}).get("status") or {}).get("conditions")
        raise AssertionError(f"{e}\nconditions: {conditions}\nsurvivor's log:\n{low.log()[-6000:]}") from None


def degraded(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    found = condition(infd(kubectl, namespace, name), "Degraded")
    return found if found and found["status"] == "True" else None


def test_unschedulable_gpu_pods_reach_status_within_seconds(
    kubectl: Kubectl, start_operator: StartOperator, namespace: str
) -> None:
    """The real scheduler refuses a GPU product no node has; the Degraded condition says so at once
    (the Deployment's progress deadline would say only "timed out", 10 minutes later)."""
    start_operator("--rollout-check-interval-s", "1")
    doc = example(REPO / "examples" / "llama-3.1-8b-h100.yaml", namespace)
    doc["spec"]["resources"]["gpuProduct"] = "NVIDIA-B200"
    doc["spec"]["scheduling"].pop("priorityClassName", None)
    doc["spec"]["autoscaling"]["minReplicas"] = 1
    doc["spec"]["autoscaling"].pop("scaleToZeroAfterSeconds", None)
    kubectl.apply(doc, "--server-side", "--field-manager=alice")
    t0 = time.monotonic()
    found = wait_for(lambda: degraded(kubectl, namespace, doc["metadata"]["name"]), 30, "Degraded")
    assert found["reason"] == "Unschedulable", found
    assert "didn't match Pod's node affinity/selector" in found["message"], found["message"]
    assert time.monotonic() - t0 < 30
    events = kubectl("get", "events", "-n", namespace, "--field-selector", "reason=Unschedulable")
    assert doc["metadata"]["name"] in events


def test_crash_loop_with_the_launchers_message_reaches_status(
    kubectl: Kubectl, start_operator: StartOperator, namespace: str
) -> None:
    """kwok runs no container, so the test writes the pod status the kubelet writes for a launcher
    that exits 3 (its termination message, as terminationMessagePolicy FallbackToLogsOnError keeps it)."""
    start_operator("--rollout-check-interval-s", "1")
    kubectl.apply(tiny_spec(namespace, name="crashy", minReplicas=1), "--server-side", "--field-manager=alice")
    pod = wait_for(lambda: (pods(kubectl, namespace, "crashy") or [None])[0], 30, "a pod")
    template = kubectl.json("get", "deployment", "crashy-engine", "-n", namespace)["spec"]["template"]
    assert template["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    message = "kvfleet launcher failed in phase pull: sha256 mismatch for model.safetensors"
    status = {
        "status": {
            "conditions": [{"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "x",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s"}},
                    "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": message}},
                }
            ],
        }
    }
    kubectl(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "-n",
        namespace,
        "--subresource=status",
        "--type=strategic",
        "-p",
        json.dumps(status),
    )
    found = wait_for(lambda: degraded(kubectl, namespace, "crashy"), 20, "Degraded")
    assert found["reason"] == "CrashLoopBackOff"
    assert message in found["message"] and "exit code 3" in found["message"]
