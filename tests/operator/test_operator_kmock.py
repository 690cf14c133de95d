"""The real kopf operator against KMock: children, status, updates, deletes, invalid specs, drift."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml
from aiohttp import web
from conftest import pick_free_port

from kvfleet.engine_image.errors import LaunchError
from kvfleet.engine_image.launch_spec import parse_launch_spec
from kvfleet.engine_image.launcher import LaunchDeps, Launcher
from kvfleet.engine_image.settings import LauncherSettings
from kvfleet_testkit.kube_emulator import (
    CONFIGMAPS,
    DEPLOYMENTS,
    EVENTS,
    INFD,
    PDBS,
    PEERINGS,
    SERVICE_MONITORS,
    SERVICES,
    Cluster,
    RunningOperator,
    eventually,
    operator_settings,
    start_operator,
    stop_operator,
)

NS = "default"
# kmock 0.8 loads its bundled resources with a deprecated importlib call.
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def tiny(name: str = "tiny", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": "file:///models/tiny", "servedName": "tiny"},
        "engine": {"kind": "reference"},
        "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi", "shmSize": "256Mi"},
        "replicas": 1,
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return None


def events_for(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [
        obj.raw
        for (res, _ns, _n), obj in cluster.api.objects.items()
        if res == EVENTS and not obj.deleted and obj.raw.get("involvedObject", {}).get("name") == name
    ]


async def test_create_gives_children_and_status(cluster: Cluster, operator: RunningOperator) -> None:
    created = await cluster.create_infd(tiny())
    uid = created["metadata"]["uid"]
    dep = await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the engine Deployment")
    for resource, child in ((SERVICES, "tiny-engine"), (CONFIGMAPS, "tiny-engine-spec"), (PDBS, "tiny-engine-pdb")):
        obj = await eventually(lambda r=resource, c=child: cluster.get(r, NS, c), what=child)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["template"]["spec"]["containers"][0]["command"][:3] == ["kvfleet", "engine", "launch"]
    # Every apply went through server-side apply with our field manager.
    applies = [r for r in cluster.writes() if r.headers.get("Content-Type", "").startswith("application/apply")]
    assert {r.params.get("fieldManager") for r in applies} == {"kvfleet-operator"}
    assert all(r.params.get("force") == "true" for r in applies)
    # kopf writes nothing to the object (no finalizer, no diff-base annotation): the operator's
    # status is the only write it gets (its children are applied, its Events created).
    assert [r for r in cluster.writes() if r.resource == INFD and r.subresource != "status"] == []

    # Pods are starting: Progressing, not Ready.
    infd = await eventually(
        lambda: (o := cluster.get(INFD, NS, "tiny")) and condition(o, "Ready") and o, what="status conditions"
    )
    assert condition(infd, "Ready")["reason"] == "NoReplicaReady"  # type: ignore[index]
    assert infd["status"]["observedGeneration"] == 1
    assert infd["status"]["endpoint"] == operator.settings.router_endpoint
    assert infd["status"]["selector"] == "app.kubernetes.io/name=kvfleet-engine,kvfleet.io/deployment=tiny"

    # The Deployment controller reports a ready replica: Ready, readyReplicas, an Event.
    await cluster.roll_out(NS, "tiny", ready=1)
    infd = await eventually(
        lambda: (o := cluster.get(INFD, NS, "tiny")) and (condition(o, "Ready") or {}).get("status") == "True" and o,
        what="Ready=True",
    )
    assert infd["status"]["readyReplicas"] == 1
    assert condition(infd, "Progressing")["reason"] == "Complete"  # type: ignore[index]
    assert condition(infd, "Degraded")["status"] == "False"  # type: ignore[index]
    assert condition(infd, "ScaledToZero")["status"] == "False"  # type: ignore[index]
    # One Event for the last replica ready (Ready and Progressing=Complete together); none for the
    # bring-up steps within one status (Creating to NoReplicaReady to RollingOut).
    await eventually(
        lambda: "ReplicasReady" in {e["reason"] for e in events_for(cluster, "tiny")}, what="the Ready event"
    )
    # The first status's one Event (Ready=False: the Deployment just applied, no replica yet) and Ready's.
    reasons = sorted(e["reason"] for e in events_for(cluster, "tiny"))
    assert reasons == ["NoReplicaReady", "ReplicasReady"], reasons
    # The operator never writes spec.
    infd_writes = [r for r in cluster.writes() if r.resource == INFD and r.subresource is None]
    assert not [r for r in infd_writes if isinstance(r.data, dict) and "spec" in r.data]


async def test_second_reconcile_sends_no_write(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create_infd(tiny())
    await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
    await cluster.roll_out(NS, "tiny", ready=1)
    await eventually(
        lambda: (condition(cluster.get(INFD, NS, "tiny"), "Ready") or {}).get("status") == "True", what="Ready"
    )
    # Let the writes of the first reconciles and their events settle, then count over several resyncs.
    await _quiet(cluster)
    before_writes, before_all = len(cluster.writes()), len(list(cluster.api))
    await _sleep(operator.settings.resync_interval_s * 4)
    assert cluster.writes()[before_writes:] == []
    # Children and pods come from the operator's watches and the object from kopf's: a converged
    # deployment's resyncs send no request at all (operator/child_cache.py).
    sent = [f"{r.method.value} {r.resource} {r.name}" for r in list(cluster.api)[before_all:]]
    assert sent == [], sent
    # The timer did run, from the cache: a Service deleted by hand (nothing else reacts to it) is back.
    await cluster.delete(f"/api/v1/namespaces/{NS}/services/tiny-engine")
    await eventually(lambda: cluster.get(SERVICES, NS, "tiny-engine"), what="the Service restored by the resync")


async def test_restart_resumes_without_writes(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create_infd(tiny())
    await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
    await cluster.roll_out(NS, "tiny", ready=1)
    await eventually(
        lambda: (condition(cluster.get(INFD, NS, "tiny"), "Ready") or {}).get("status") == "True", what="Ready"
    )
    await _quiet(cluster)
    await stop_operator(operator)
    before, before_all = len(cluster.writes()), len(list(cluster.api))
    second = await start_operator(cluster, operator_settings())
    try:
        await _sleep(1.5)
        assert cluster.writes()[before:] == []
        # The resumed operator did reconcile: it listed the children back (its cache's first LIST).
        reads = [r for r in list(cluster.api)[before_all:] if r.method.value == "GET" and r.resource == DEPLOYMENTS]
        assert reads
    finally:
        await stop_operator(second)


async def test_update_rolls_the_deployment(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create_infd(tiny())
    dep = await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
    old_hash = dep["spec"]["template"]["metadata"]["annotations"]["kvfleet.io/spec-hash"]
    await cluster.patch_infd(NS, "tiny", {"spec": {"engine": {"maxModelLen": 1024}, "replicas": 2}})

    def rolled() -> dict[str, Any] | None:
        d = cluster.get(DEPLOYMENTS, NS, "tiny-engine")
        annotations = (d or {})["spec"]["template"]["metadata"]["annotations"]
        return d if annotations["kvfleet.io/spec-hash"] != old_hash and d["spec"]["replicas"] == 2 else None

    await eventually(rolled, what="a new pod template and 2 replicas")
    spec_json = cluster.get(CONFIGMAPS, NS, "tiny-engine-spec")["data"]["spec.json"]  # type: ignore[index]
    assert '"maxModelLen": 1024' in spec_json
    infd = await eventually(
        lambda: (o := cluster.get(INFD, NS, "tiny")) and o.get("status", {}).get("observedGeneration") == 2 and o,
        what="observedGeneration 2",
    )
    assert infd["status"]["desiredReplicas"] == 2


async def test_autoscaler_decision_scales_and_zero_is_reported(cluster: Cluster, operator: RunningOperator) -> None:
    doc = tiny(autoscaling={"minReplicas": 0, "maxReplicas": 3, "coldStartSeconds": 10})
    del doc["spec"]["replicas"]
    await cluster.create_infd(doc)
    await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
    assert cluster.get(DEPLOYMENTS, NS, "tiny-engine")["spec"]["replicas"] == 0  # type: ignore[index]
    await cluster.roll_out(NS, "tiny", ready=0)
    infd = await eventually(
        lambda: (
            (o := cluster.get(INFD, NS, "tiny")) and (condition(o, "ScaledToZero") or {}).get("status") == "True" and o
        ),
        what="ScaledToZero",
    )
    assert condition(infd, "Ready")["reason"] == "ScaledToZero"  # type: ignore[index]
    assert "desiredReplicas" not in infd["status"]  # the autoscaler's key: the operator leaves it alone

    # The autoscaler writes its decision into status; the watch handler applies it at once.
    await cluster.patch_infd(NS, "tiny", {"status": {"desiredReplicas": 5}}, subresource="status")
    await eventually(
        lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine")["spec"]["replicas"] == 3,  # type: ignore[index]
        what="replicas clamped to maxReplicas",
    )


async def test_invalid_spec_sets_degraded_and_creates_nothing(cluster: Cluster, operator: RunningOperator) -> None:
    bad = tiny("broken", engine={"kind": "reference", "tensorParallelSize": 2})
    await cluster.create_infd(bad)
    infd = await eventually(
        lambda: (o := cluster.get(INFD, NS, "broken")) and condition(o, "Degraded") and o, what="Degraded"
    )
    degraded = condition(infd, "Degraded")
    assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.engine.tensorParallelSize" in degraded["message"]
    await eventually(
        lambda: any(e["reason"] == "InvalidSpec" for e in events_for(cluster, "broken")), what="an InvalidSpec event"
    )
    # Not retried in a loop: over several resyncs nothing more is written, no child appears.
    await _quiet(cluster)
    before = len(cluster.writes())
    await _sleep(operator.settings.resync_interval_s * 4)
    assert cluster.writes()[before:] == []
    for resource, child in (
        (DEPLOYMENTS, "broken-engine"),
        (SERVICES, "broken-engine"),
        (CONFIGMAPS, "broken-engine-spec"),
        (PDBS, "broken-engine-pdb"),
    ):
        assert cluster.get(resource, NS, child) is None
    assert len([e for e in events_for(cluster, "broken") if e["reason"] == "InvalidSpec"]) == 1


async def test_invalid_update_leaves_children_unchanged(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create_infd(tiny())
    dep = await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
    await cluster.patch_infd(NS, "tiny", {"spec": {"resources": {"gpus": 0}, "engine": {"kind": "sglang"}}})
    infd = await eventually(
        lambda: (
            (o := cluster.get(INFD, NS, "tiny"))
            and (condition(o, "Degraded") or {}).get("reason") == "InvalidSpec"
            and o
        ),
        what="Degraded/InvalidSpec",
    )
    assert "spec.resources.gpus" in condition(infd, "Degraded")["message"]  # type: ignore[index]
    assert cluster.get(DEPLOYMENTS, NS, "tiny-engine")["spec"] == dep["spec"]  # type: ignore[index]


async def test_hand_deleted_and_edited_children_come_back(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create_infd(tiny())
    await eventually(lambda: cluster.get(SERVICES, NS, "tiny-engine"), what="the Service")
    await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
    await cluster.delete(f"/api/v1/namespaces/{NS}/services/tiny-engine")
    assert cluster.get(SERVICES, NS, "tiny-engine") is None
    await eventually(lambda: cluster.get(SERVICES, NS, "tiny-engine"), what="the Service restored")
    # A hand edit of a field the operator owns is put back.
    await cluster.call(
        "PATCH",
        f"/apis/apps/v1/namespaces/{NS}/deployments/tiny-engine",
        {"spec": {"replicas": 7}},
        "application/merge-patch+json",
    )
    await eventually(
        lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine")["spec"]["replicas"] == 1,  # type: ignore[index]
        what="replicas restored to 1",
    )


async def test_delete_goes_at_once_and_leaves_the_children_to_garbage_collection(
    cluster: Cluster, operator: RunningOperator
) -> None:
    """No finalizer: the operator writes nothing to the object but status, so a delete is not held
    back (a namespace of 50 went in one pass). Every child names the deployment as its controller
    owner, which is what Kubernetes' garbage collector removes them by (KMock has none; the real
    control plane's test, tests/k8s/test_operator_real.py, sees them collected)."""
    created = await cluster.create_infd(tiny())
    await eventually(lambda: cluster.get(PDBS, NS, "tiny-engine-pdb"), what="the children")
    await eventually(lambda: condition(cluster.get(INFD, NS, "tiny"), "Ready"), what="status")
    assert not (cluster.get(INFD, NS, "tiny") or {})["metadata"].get("finalizers")
    infd_writes = [r for r in cluster.writes() if r.resource == INFD]
    assert infd_writes and all(r.subresource == "status" for r in infd_writes), infd_writes
    await cluster.delete(f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/inferencedeployments/tiny")
    assert cluster.get(INFD, NS, "tiny") is None
    for resource, child in (
        (DEPLOYMENTS, "tiny-engine"),
        (SERVICES, "tiny-engine"),
        (CONFIGMAPS, "tiny-engine-spec"),
        (CONFIGMAPS, "tiny-engine-pin"),
        (PDBS, "tiny-engine-pdb"),
    ):
        owners = (cluster.get(resource, NS, child) or {})["metadata"]["ownerReferences"]
        assert [(o["uid"], o["controller"]) for o in owners] == [(created["metadata"]["uid"], True)], child


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def _quiet(cluster: Cluster, window_s: float = 1.0, timeout_s: float = 10.0) -> None:
    """Wait until the operator has sent no write for ``window_s`` (queued events, kopf bookkeeping)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    count, since = len(cluster.writes()), loop.time()
    while loop.time() - since < window_s:
        assert loop.time() < deadline, f"the operator kept writing: {[str(r.url) for r in cluster.writes()[-5:]]}"
        await asyncio.sleep(0.1)
        if len(cluster.writes()) != count:
            count, since = len(cluster.writes()), loop.time()


async def test_service_monitor_when_its_crd_is_served(cluster: Cluster) -> None:
    cluster.api.resources["monitoring.coreos.com/v1/servicemonitors"] = kmock.ResourceInfo(
        kind="ServiceMonitor",
        singular="servicemonitor",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    )
    running = await start_operator(cluster, operator_settings())
    try:
        await cluster.create_infd(tiny())
        monitor = await eventually(lambda: cluster.get(SERVICE_MONITORS, NS, "tiny-engine"), what="the ServiceMonitor")
        assert monitor["spec"]["selector"]["matchLabels"]["kvfleet.io/deployment"] == "tiny"
    finally:
        await stop_operator(running)


async def test_measured_cold_start_and_model_digest_come_from_the_launcher(cluster: Cluster, free_port: int) -> None:
    """A real HTTP launcher endpoint on loopback stands in for the pod's port 9400."""
    app = web.Application()
    asked: list[str] = []

    async def coldstart(request: web.Request) -> web.Response:
        asked.append(request.path)
        report = {"totalSeconds": 42.5, "phases": {"pull": 30.0, "load": 12.5}, "modelDigest": "5e" * 32}
        return web.json_response(report)

    app.router.add_get("/coldstart", coldstart)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    running = await start_operator(cluster, operator_settings(launcher_port=free_port))
    try:
        await cluster.create_infd(tiny())
        await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "tiny-engine-abc",
                "namespace": NS,
                "labels": {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.io/deployment": "tiny"},
            },
            "status": {
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}],
            },
        }
        await cluster.call("POST", f"/api/v1/namespaces/{NS}/pods", pod)
        await cluster.roll_out(NS, "tiny", ready=1)
        infd = await eventually(
            lambda: (o := cluster.get(INFD, NS, "tiny")) and "measuredColdStartSeconds" in o.get("status", {}) and o,
            what="measuredColdStartSeconds",
        )
        assert infd["status"]["measuredColdStartSeconds"] == 42.5
        assert infd["status"]["modelDigest"] == "5e" * 32
        await _sleep(running.settings.resync_interval_s * 3)
        assert asked == ["/coldstart"]  # asked once per pod, remembered after
    finally:
        await stop_operator(running)
        await runner.cleanup()


class HeldPull:
    """A weight puller that reports the bytes the test moves and holds until released: the real
    launcher serves its real /progress from it, on the port the operator asks."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.started = threading.Event()
        self.release = threading.Event()
        self.progress: Any = None

    def pull(self, launch: Any, progress: Any) -> Any:
        progress.on_start(self.total_bytes, 0)
        self.progress = progress
        self.started.set()
        self.release.wait(60)
        raise LaunchError("pull", "the test is over")


async def test_progressing_says_how_far_the_weight_pull_is(cluster: Cluster, free_port: int, tmp_path: Path) -> None:
    now = [0.0]
    held = HeldPull(140 * 10**9)
    launcher = Launcher(
        parse_launch_spec({"name": "tiny", "spec": tiny()["spec"]}),
        LauncherSettings(
            node_cache_dir=tmp_path, engine_port=pick_free_port(), metrics_host="127.0.0.1", metrics_port=free_port
        ),
        LaunchDeps(weights=held, clock=lambda: now[0]),
    )
    launch = asyncio.create_task(launcher.run())
    running = await start_operator(cluster, operator_settings(launcher_port=free_port, rollout_check_interval_s=0.3))
    try:
        assert await asyncio.to_thread(held.started.wait, 10)
        now[0] = 49.0
        held.progress.on_bytes(58_800_000_000)  # 58.8 GB in 49 s: 1.2 GB/s, 81.2 GB left
        await cluster.create_infd(tiny())
        await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
        await cluster.call("POST", f"/api/v1/namespaces/{NS}/pods", _engine_pod(ready=False))
        status = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 0}
        deployment_status = f"/apis/apps/v1/namespaces/{NS}/deployments/tiny-engine/status"
        await cluster.call("PATCH", deployment_status, {"status": status}, "application/merge-patch+json")

        def progressing() -> dict[str, Any]:
            return condition(cluster.get(INFD, NS, "tiny"), "Progressing") or {}

        said = "0/1 replicas ready; pulling 42% (58/140 GB), 1.20 GB/s, 1m08s left"
        await eventually(lambda: progressing().get("message") == said, what="the pull in Progressing")
        assert (progressing()["status"], progressing()["reason"]) == ("True", "ScalingUp")

        # The bytes move on; the message follows within a rollout check, without an Event per tick.
        # (kopf posts Events from a queue: wait for the first status's before counting; the step to
        # ScalingUp within Progressing=True posts none.)
        await eventually(lambda: events_for(cluster, "tiny"), what="the first Event")
        events_before = len(events_for(cluster, "tiny"))
        now[0] = 59.0
        held.progress.on_bytes(12_000_000_000)
        await eventually(lambda: "pulling 50% (70/140 GB)" in progressing().get("message", ""), what="the new figure")
        await _sleep(running.settings.rollout_check_interval_s * 3)
        assert len(events_for(cluster, "tiny")) == events_before

        # Ready: the pull is over, and the condition no longer speaks of it.
        await cluster.call("DELETE", f"/api/v1/namespaces/{NS}/pods/tiny-engine-abc")
        await cluster.call("POST", f"/api/v1/namespaces/{NS}/pods", _engine_pod(ready=True, name="tiny-engine-def"))
        await cluster.roll_out(NS, "tiny", ready=1)
        await eventually(lambda: progressing().get("status") == "False", what="Progressing False")
        assert "pulling" not in progressing()["message"]
    finally:
        held.release.set()
        await stop_operator(running)
        with pytest.raises(LaunchError):
            await asyncio.wait_for(launch, 20)


def _engine_pod(ready: bool, name: str = "tiny-engine-abc") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.io/deployment": "tiny"},
        },
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": "2025-01-01T00:00:00Z"}
            ],
            "containerStatuses": [{"name": "engine", "state": {"running": {"startedAt": "2025-01-01T00:00:00Z"}}}],
        },
    }


async def test_peering_lets_only_the_highest_priority_replica_work(cluster: Cluster) -> None:
    """Two replicas with kopf peering: the higher priority one reconciles, the other stands by."""
    cluster.api.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
        kind="ClusterKopfPeering",
        singular="clusterkopfpeering",
        namespaced=False,
        verbs={"get", "list", "watch", "patch"},
    )
    await cluster.call(
        "POST",
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvfleet"}},
    )
    low = await start_operator(
        cluster, operator_settings(peering_name="kvfleet", priority=10, router_endpoint="http://low/v1")
    )
    high = await start_operator(
        cluster, operator_settings(peering_name="kvfleet", priority=20, router_endpoint="http://high/v1")
    )
    try:
        # Both see each other through the peering object before any work arrives.
        await eventually(
            lambda: len((cluster.get(PEERINGS, None, "kvfleet") or {}).get("status") or {}) >= 2,
            what="both replicas in the peering object",
        )
        await _sleep(1.0)
        await cluster.create_infd(tiny())
        infd = await eventually(
            lambda: (o := cluster.get(INFD, NS, "tiny")) and o.get("status", {}).get("endpoint") and o,
            what="a status from one replica",
        )
        await _sleep(low.settings.resync_interval_s * 4)
        infd = cluster.get(INFD, NS, "tiny")
        assert infd is not None and infd["status"]["endpoint"] == "http://high/v1"
        # The paused replica never wrote: no version of the object ever carried its endpoint.
        versions = cluster.api.objects[INFD, NS, "tiny"].history
        endpoints = {((v or {}).get("status") or {}).get("endpoint") for v in versions}
        assert "http://low/v1" not in endpoints
    finally:
        await stop_operator(high)
        await stop_operator(low)


async def test_cli_runs_the_operator_with_kubeconfig_and_health(cluster: Cluster, tmp_path: Path) -> None:
    """`kvfleet operator run` as a subprocess: kubeconfig login, the liveness endpoint, a reconcile."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
                "users": [{"name": "kmock", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
            }
        )
    )
    port = pick_free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvfleet.cli",
        "operator",
        "run",
        "--port",
        str(port),
        "--resync-interval-s",
        "1",
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:

        async def healthy() -> bool:
            try:
                async with cluster.http.get(f"http://127.0.0.1:{port}/healthz") as response:
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        deadline = asyncio.get_running_loop().time() + 30
        while not await healthy():
            assert proc.returncode is None, "the operator exited"
            assert asyncio.get_running_loop().time() < deadline, "no /healthz"
            await asyncio.sleep(0.2)
        await cluster.create_infd(tiny())
        await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
        assert any(r.headers.get("Authorization") == "Bearer test-token" for r in list(cluster.api))
        # One identity: kopf's own requests and the operator's client's carry the same credentials.
        ours = [r for r in list(cluster.api) if r.headers.get("User-Agent") != "test-kubectl"]
        agents = {r.headers.get("User-Agent", "").split("/")[0] for r in ours}
        assert {"kopf", "kvfleet-operator"} <= agents
        assert {r.headers.get("Authorization") for r in ours} == {"Bearer test-token"}
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=20)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def claimant(namespace: str, created: str) -> dict[str, Any]:
    doc = tiny()
    doc["metadata"].update(namespace=namespace, creationTimestamp=created)
    return doc


async def test_newer_claimant_of_a_served_name_is_refused_and_recovers_when_it_is_free(cluster: Cluster) -> None:
    """ "aaa" sorts first but claims "tiny" a day later than "zzz": it gets Ready=False ServedNameConflict
    naming zzz/tiny, a Warning Event and no pods; once zzz/tiny is deleted it takes the name by itself."""
    running = await start_operator(cluster, operator_settings(rollout_check_interval_s=0.5))
    try:
        await cluster.create_infd(claimant("zzz", "2026-01-01T00:00:00Z"))
        await eventually(lambda: cluster.get(DEPLOYMENTS, "zzz", "tiny-engine"), what="the older claimant's pods")
        await cluster.create_infd(claimant("aaa", "2026-01-02T00:00:00Z"))
        newer = await eventually(
            lambda: (o := cluster.get(INFD, "aaa", "tiny")) and condition(o, "Ready") and o, what="the newer's status"
        )
        ready = condition(newer, "Ready")
        assert ready is not None and (ready["status"], ready["reason"]) == ("False", "ServedNameConflict")
        assert ready["message"] == 'served name "tiny" is already served by zzz/tiny since 2026-01-01T00:00:00Z'
        warnings = await eventually(
            lambda: [
                e
                for e in events_for(cluster, "tiny")
                if e["involvedObject"].get("namespace") == "aaa" and e["reason"] == "ServedNameConflict"
            ],
            what="a ServedNameConflict event",
        )
        assert [e["type"] for e in warnings] == ["Warning"]
        assert 'served name "tiny" is already served by zzz/tiny' in warnings[0]["message"]
        await _sleep(running.settings.rollout_check_interval_s * 3)
        assert cluster.get(DEPLOYMENTS, "aaa", "tiny-engine") is None  # no pods for a name it does not hold
        older = cluster.get(INFD, "zzz", "tiny")
        assert (condition(older, "Degraded") or {}).get("reason") != "ServedNameConflict"

        loop = asyncio.get_running_loop()
        await cluster.delete("/apis/kvfleet.io/v1alpha1/namespaces/zzz/inferencedeployments/tiny")
        await eventually(lambda: cluster.get(INFD, "zzz", "tiny") is None, what="the older claimant to go")
        gone_s = loop.time()
        await eventually(lambda: cluster.get(DEPLOYMENTS, "aaa", "tiny-engine"), what="the newer's pods")
        recovered = await eventually(
            lambda: (
                (o := cluster.get(INFD, "aaa", "tiny"))
                and (condition(o, "Degraded") or {}).get("reason") != "ServedNameConflict"
                and o
            ),
            what="the conflict to clear",
        )
        took_s = loop.time() - gone_s
        # The rollout check looks again every rollout_check_interval_s while the conflict stands.
        assert took_s < running.settings.rollout_check_interval_s + 2.0, took_s
        print(f"recovered {took_s:.2f} s after the older claimant was deleted")
        assert (condition(recovered, "Ready") or {}).get("reason") != "ServedNameConflict"
    finally:
        await stop_operator(running)


async def test_the_first_served_digest_is_pinned_without_rolling_and_a_model_change_resets_it(
    cluster: Cluster, free_port: int
) -> None:
    """A real HTTP launcher endpoint on loopback answers for the engine pod (port 9400)."""
    app = web.Application()
    served = {"digest": "5e" * 32}

    async def coldstart(request: web.Request) -> web.Response:
        return web.json_response({"totalSeconds": 3.0, "modelDigest": served["digest"]})

    app.router.add_get("/coldstart", coldstart)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    running = await start_operator(cluster, operator_settings(launcher_port=free_port))
    model = {"uri": "s3://weights/models/tiny", "servedName": "tiny"}
    try:
        await cluster.create_infd(tiny(model=model, cache={"bucket": "weights"}))
        dep = await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "tiny-engine"), what="the Deployment")
        pin = await eventually(lambda: cluster.get(CONFIGMAPS, NS, "tiny-engine-pin"), what="the pin ConfigMap")
        assert pin["data"]["modelDigest"] == ""  # nothing served yet
        template = dep["spec"]["template"]
        spec_hash = template["metadata"]["annotations"]["kvfleet.io/spec-hash"]
        pod = _engine_pod(ready=True)
        pod["metadata"]["annotations"] = {"kvfleet.io/spec-hash": spec_hash}
        await cluster.call("POST", f"/api/v1/namespaces/{NS}/pods", pod)
        await cluster.roll_out(NS, "tiny", ready=1)
        await eventually(
            lambda: (
                (cluster.get(CONFIGMAPS, NS, "tiny-engine-pin") or {}).get("data", {}).get("modelDigest") == "5e" * 32
            ),
            what="the pinned digest",
        )
        infd = await eventually(
            lambda: (o := cluster.get(INFD, NS, "tiny")) and o.get("status", {}).get("modelDigest") and o,
            what="status.modelDigest",
        )
        assert infd["status"]["modelDigest"] == "5e" * 32
        # Pinning wrote a ConfigMap, not the pod template: no GPU pod rolls.
        assert cluster.get(DEPLOYMENTS, NS, "tiny-engine")["spec"]["template"] == template  # type: ignore[index]

        # A new model: the pin is reset, and the old pod (old spec hash, old digest) does not pin again.
        served["digest"] = "7a" * 32
        await cluster.patch_infd(NS, "tiny", {"spec": {"model": {"uri": "s3://weights/models/other"}}})
        await eventually(
            lambda: (
                (cluster.get(CONFIGMAPS, NS, "tiny-engine-pin") or {}).get("data", {}).get("model", "")
                == '{"revision":null,"uri":"s3://weights/models/other"}'
            ),
            what="the pin reset",
        )
        await _sleep(running.settings.resync_interval_s * 3)
        assert cluster.get(CONFIGMAPS, NS, "tiny-engine-pin")["data"]["modelDigest"] == ""  # type: ignore[index]
    finally:
        await stop_operator(running)
        await runner.cleanup()
