"""Kubernetes replica discovery against KMock (a real HTTP Kubernetes API emulator), and its pure parts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.watch_api import WatchApi

from kvfleet.kube.client import KubeClient
from kvfleet.router.kubernetes_source import (
    KubernetesReplicaSource,
    PublishPacing,
    build_snapshot,
    slice_endpoints,
)
from kvfleet.router.replicas import DeploymentView, Snapshot
from kvfleet_testkit.kmock_resources import register_inference_deployments

from .conftest import Backend, running_router, until

IDS = "/apis/kvfleet.io/v1alpha1/namespaces/{ns}/inferencedeployments"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


def deployment(name: str, ns: str = "team", served: str | None = None, **routing: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"uri": "s3://models/llama"}
    if served:
        model["servedName"] = served
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {"model": model, "routing": routing},
    }


def endpoint(
    pod: str, ip: str, *, ready: bool = True, terminating: bool = False, serving: bool = True
) -> dict[str, Any]:
    return {
        "addresses": [ip],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "team"},
    }


def endpoint_slice(name: str, owner: str, endpoints: list[dict[str, Any]], ns: str = "team") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "labels": {"kvfleet.io/deployment": owner, "app.kubernetes.io/name": "kvfleet-engine"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


class Recorder:
    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []

    def apply(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)

    @property
    def last(self) -> dict[str, DeploymentView]:
        """The last snapshot by served name (a snapshot holds one view per served name)."""
        return {view.served_name: view for view in self.snapshots[-1].values()}


@pytest.fixture
async def k8s_url() -> AsyncIterator[str]:
    k8s = emulator()
    async with k8s, kmock.Server(k8s) as server:
        yield str(server.url).rstrip("/")


async def kube(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> None:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else None
    async with session.request(method, url, json=body, headers=headers) as resp:
        assert resp.status < 300, await resp.text()


async def test_watches_deployments_and_ready_endpoints(k8s_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await kube(session, "POST", k8s_url + IDS.format(ns="team"), deployment("llama", served="llama-3", maxQueue=7))
        await kube(
            session,
            "POST",
            k8s_url + SLICES.format(ns="team"),
            endpoint_slice("llama-engine-abc", "llama", [endpoint("llama-0", "10.0.0.1")]),
        )
        # A slice of something else, unlabelled: ignored.
        other = endpoint_slice("web", "x", [endpoint("web-0", "10.0.9.9")])
        del other["metadata"]["labels"]
        await kube(session, "POST", k8s_url + SLICES.format(ns="team"), other)

        source = KubernetesReplicaSource(KubeClient.for_server(k8s_url), namespace="team", backoff_base_s=0.05)
        recorder = Recorder()
        await source.start(recorder)
        try:
            view = recorder.last["llama-3"]
            assert (view.namespace, view.name, view.routing.max_queue) == ("team", "llama", 7)
            assert [(e.replica_id, e.url, e.draining) for e in view.endpoints] == [
                ("llama-0", "http://10.0.0.1:8000", False)
            ]
            # A scale-up adds a not-yet-ready pod: not routable until ready.
            url = k8s_url + SLICES.format(ns="team") + "/llama-engine-abc"
            two = [endpoint("llama-0", "10.0.0.1"), endpoint("llama-1", "10.0.0.2", ready=False)]
            await kube(session, "PATCH", url, {"endpoints": two})
            await until(lambda: len(recorder.snapshots) >= 2)
            assert [e.replica_id for e in recorder.last["llama-3"].endpoints] == ["llama-0"]
            two[1]["conditions"]["ready"] = True
            await kube(session, "PATCH", url, {"endpoints": two})
            await until(lambda: len(recorder.last["llama-3"].endpoints) == 2)
            # Pod terminating but still serving: draining (no new requests, in-flight finish).
            two[0]["conditions"].update(ready=False, terminating=True)
            await kube(session, "PATCH", url, {"endpoints": two})
            await until(lambda: recorder.last["llama-3"].endpoints[0].draining)
            # The deployment goes away: the model is no longer served.
            await kube(session, "DELETE", k8s_url + IDS.format(ns="team") + "/llama")
            await until(lambda: "llama-3" not in recorder.last)
        finally:
            await source.stop()


async def test_served_from_zero_replicas_then_a_new_deployment_appears(k8s_url: str) -> None:
    source = KubernetesReplicaSource(KubeClient.for_server(k8s_url), backoff_base_s=0.05)
    recorder = Recorder()
    await source.start(recorder)
    try:
        assert dict(recorder.last) == {}
        async with aiohttp.ClientSession() as session:
            await kube(session, "POST", k8s_url + IDS.format(ns="b"), deployment("qwen", ns="b"))
            await until(lambda: "qwen" in recorder.last)
            assert recorder.last["qwen"].endpoints == ()  # known model with no replica: the activator holds
            # The operator writes the pull's progress into status: held clients are told it (cold_hold.py).
            pulling = "0/1 replicas updated; pulling 42% (58/140 GB), 1.20 GB/s, 1m08s left"
            progressing = {"type": "Progressing", "status": "True", "reason": "ScalingUp", "message": pulling}
            patch = {"status": {"measuredColdStartSeconds": 95.5, "conditions": [progressing]}}
            await kube(session, "PATCH", k8s_url + IDS.format(ns="b") + "/qwen/status", patch)
            await until(lambda: recorder.last["qwen"].cold_start.progress is not None)
            cold = recorder.last["qwen"].cold_start
            assert (cold.estimate_s, cold.progress_eta_s) == (95.5, 68.0) and cold.progress == pulling.split("; ")[1]
    finally:
        await source.stop()


async def test_unreachable_api_server_fails_start_with_a_reason(free_port: int) -> None:
    source = KubernetesReplicaSource(
        KubeClient.for_server(f"http://127.0.0.1:{free_port}", timeout_s=2), start_attempts=2, backoff_base_s=0.05
    )
    with pytest.raises(Exception, match=r"GET /apis/kvfleet\.io/.*Cannot connect to host"):
        await source.start(Recorder())
    await source.stop()


@pytest.mark.parametrize(("status", "attempts"), [(429, 2), (503, 2), (403, 1)])
async def test_start_retries_only_what_can_heal(free_port: int, status: int, attempts: int) -> None:
    """A 429 ("storage is (re)initializing" right after a CRD is created, seen on a real API server)
    or a 5xx is retried with jittered backoff; a 403 fails at once with its reason."""
    from aiohttp import web

    calls: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        calls.append(request.path)
        if len(calls) == 1:
            return web.json_response({"kind": "Status", "code": status}, status=status, headers={"Retry-After": "1"})
        return web.json_response({"kind": "List", "metadata": {"resourceVersion": "1"}, "items": []})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    source = KubernetesReplicaSource(
        KubeClient.for_server(f"http://127.0.0.1:{free_port}"), start_attempts=3, backoff_base_s=0.05, watch_timeout_s=1
    )
    try:
        if attempts == 1:
            with pytest.raises(Exception, match=f"HTTP {status}"):
                await source.start(Recorder())
        else:
            await source.start(Recorder())
        assert calls[:attempts] == ["/apis/kvfleet.io/v1alpha1/inferencedeployments"] * attempts
    finally:
        await source.stop()
        await runner.cleanup()


def test_snapshot_rules_by_hand() -> None:
    newer, older = deployment("llama", ns="a"), deployment("llama", ns="b")
    newer["metadata"]["creationTimestamp"] = "2026-01-02T00:00:00Z"
    older["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    deployments = {
        ("a", "llama"): newer,  # same served name in an earlier-sorting namespace, created later: not routed
        ("b", "llama"): older,
        ("a", "broken"): {"metadata": {"name": "broken", "namespace": "a"}, "spec": {"model": {"uri": "ftp://x"}}},
    }
    slices = {
        ("a", "s1"): endpoint_slice(
            "s1",
            "llama",
            [
                endpoint("p0", "10.0.0.1"),
                endpoint("p1", "10.0.0.2", ready=False),
                endpoint("p2", "10.0.0.3", ready=False, terminating=True),
                endpoint("p3", "10.0.0.4", ready=False, terminating=True, serving=False),
                endpoint("p6", "fd00::6"),
            ],
            ns="a",
        ),
        ("b", "s2"): endpoint_slice("s2", "llama", [endpoint("q0", "10.1.0.1")], ns="b"),
    }
    snapshot = build_snapshot(deployments, slices)
    assert list(snapshot) == ["b/llama"]
    view = snapshot["b/llama"]
    assert (view.namespace, view.created_unix_s) == ("b", 1_767_225_600)
    assert [(e.replica_id, e.url, e.draining) for e in view.endpoints] == [("q0", "http://10.1.0.1:8000", False)]
    deployments.pop(("b", "llama"))  # the older claimant goes: the other one is routed
    view = build_snapshot(deployments, slices)["a/llama"]
    assert [(e.replica_id, e.url, e.draining) for e in view.endpoints] == [
        ("p0", "http://10.0.0.1:8000", False),
        ("p2", "http://10.0.0.3:8000", True),
        ("p6", "http://[fd00::6]:8000", False),
    ]
    assert slice_endpoints({"ports": [], "endpoints": [endpoint("x", "10.0.0.1")]}) == []


def emulator() -> kmock.KubernetesEmulator:
    k8s = kmock.KubernetesEmulator()
    register_inference_deployments(k8s)
    return k8s


async def test_watch_recovers_across_an_api_server_restart(free_port: int) -> None:
    """The API server goes away (watches end or break, connections are refused) while state changes.
    Back, the source shows what changed meanwhile: replayed by the resumed watch, or, when the
    history it needed was compacted meanwhile (410 Gone), by a LIST."""
    api = WatchApi()
    collection = IDS.format(ns="team")
    await api.start(free_port)
    await api.put(collection, deployment("old"))
    source = KubernetesReplicaSource(
        KubeClient.for_server(api.url), namespace="team", backoff_base_s=0.05, backoff_max_s=0.2
    )
    recorder = Recorder()
    await source.start(recorder)
    try:
        assert list(recorder.last) == ["old"]
        await api.stop()
        await api.delete(collection, "team", "old")
        await api.put(collection, deployment("new"))
        await api.start(free_port)
        await until(lambda: list(recorder.last) == ["new"])
        lists = len(api.seen("list", "inferencedeployments"))

        await api.stop()
        await api.delete(collection, "team", "new")
        await api.put(collection, deployment("newer"))
        api.compact()
        await api.start(free_port)
        await until(lambda: list(recorder.last) == ["newer"])
        assert len(api.seen("list", "inferencedeployments")) > lists  # compacted: only a LIST can tell
    finally:
        await source.stop()
        await api.stop()


async def test_only_the_changed_deployment_is_validated_again(free_port: int) -> None:
    """An event re-validates the one InferenceDeployment it names; replica changes validate none."""
    api = WatchApi()
    await api.start(free_port)
    for name in ("a", "b", "c"):
        await api.put(IDS.format(ns="team"), deployment(name, maxQueue=5))
    source = KubernetesReplicaSource(KubeClient.for_server(api.url), namespace="team", backoff_base_s=0.05)
    recorder = Recorder()
    await source.start(recorder)
    try:
        assert source.validations == 3 and sorted(recorder.last) == ["a", "b", "c"]
        await api.put(IDS.format(ns="team"), deployment("b", maxQueue=9))
        await until(lambda: recorder.last["b"].routing.max_queue == 9)
        assert source.validations == 4
        await api.put(SLICES.format(ns="team"), endpoint_slice("a-1", "a", [endpoint("a-0", "10.0.0.1")]))
        await until(lambda: len(recorder.last["a"].endpoints) == 1)
        assert source.validations == 4
        assert [r.query.get("allowWatchBookmarks") for r in api.seen("watch")] == ["true", "true"]
        registry = CollectorRegistry()
        source.register_metrics(registry)
        text = generate_latest(registry).decode()
        assert 'kvfleet_router_kube_watch_total{event="lists",resource="inferencedeployments"} 1.0' in text
        assert 'kvfleet_router_kube_watch_total{event="events",resource="endpointslices"} 1.0' in text
    finally:
        await source.stop()
        await api.stop()


async def test_router_serves_through_kubernetes_discovery(k8s_url: str, backends: list[Backend]) -> None:
    """InferenceDeployment + EndpointSlices in the emulator, real replicas behind them, the router in front."""
    source = KubernetesReplicaSource(KubeClient.for_server(k8s_url), namespace="team", backoff_base_s=0.05)

    def slice_for(backend: Backend) -> dict[str, Any]:
        one = endpoint_slice(f"tiny-{backend.replica_id}", "tiny", [endpoint(backend.replica_id, "127.0.0.1")])
        one["ports"][0]["port"] = backend.port
        return one

    body = {"model": "tiny-chat", "prompt": "hello"}
    async with aiohttp.ClientSession() as session, running_router(source) as router:
        await kube(session, "POST", k8s_url + IDS.format(ns="team"), deployment("tiny", served="tiny-chat"))
        await until(lambda: router.fleet.view("tiny-chat") is not None)
        held = asyncio.create_task(session.post(router.url + "/v1/completions", json=body))
        await until(lambda: router.fleet.queue_depth("tiny-chat") == 1)
        for backend in backends[:2]:
            await kube(session, "POST", k8s_url + SLICES.format(ns="team"), slice_for(backend))
        async with await held as resp:
            assert resp.status == 200
        await until(lambda: len(router.fleet.inflight("tiny-chat")) == 2)
        await kube(session, "DELETE", k8s_url + SLICES.format(ns="team") + f"/tiny-{backends[0].replica_id}")
        await until(lambda: list(router.fleet.inflight("tiny-chat")) == [backends[1].replica_id])
        for _ in range(4):
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["X-Kvfleet-Replica"] == backends[1].replica_id


def test_a_slices_kv_events_port_reaches_its_endpoints() -> None:
    # The operator names the events port kv-events on the engine Service (operator/pod.py engine_ports).
    with_events = endpoint_slice("s1", "llama", [endpoint("p0", "10.0.0.1"), endpoint("p1", "fd00::1")])
    with_events["ports"] = [
        {"name": "http", "port": 8000, "protocol": "TCP"},
        {"name": "launcher", "port": 9400, "protocol": "TCP"},
        {"name": "kv-events", "port": 5557, "protocol": "TCP"},
    ]
    assert [(e.url, e.kv_events_port) for e in slice_endpoints(with_events)] == [
        ("http://10.0.0.1:8000", 5557),
        ("http://[fd00::1]:8000", 5557),
    ]
    # Without the port (events off, or an SGLang engine) the replicas announce none.
    without = endpoint_slice("s2", "llama", [endpoint("p0", "10.0.0.1")])
    assert [e.kv_events_port for e in slice_endpoints(without)] == [None]
    # A port the API would never send (unset, not a number) is no port.
    odd = endpoint_slice("s3", "llama", [endpoint("p0", "10.0.0.1")])
    odd["ports"] = [{"name": "http", "port": 8000}, {"name": "kv-events", "port": None}]
    assert [e.kv_events_port for e in slice_endpoints(odd)] == [None]


def test_a_slices_launcher_port_reaches_its_endpoints() -> None:
    # The operator names the launcher's port launcher (operator/pod.py engine_ports): the router fetches
    # the model's tokenizer files there (router/tokenizer_fetch.py).
    named = endpoint_slice("s1", "llama", [endpoint("p0", "10.0.0.1"), endpoint("p1", "fd00::1")])
    named["ports"] = [
        {"name": "http", "port": 8000, "protocol": "TCP"},
        {"name": "launcher", "port": 9400, "protocol": "TCP"},
        {"name": "kv-events", "port": 5557, "protocol": "TCP"},
    ]
    assert [(e.url, e.kv_events_port, e.launcher_port) for e in slice_endpoints(named)] == [
        ("http://10.0.0.1:8000", 5557, 9400),
        ("http://[fd00::1]:8000", 5557, 9400),
    ]
    # Unnamed, unset or not a number: no launcher port known, so nothing is fetched from it.
    for ports in (
        [{"name": "http", "port": 8000}],
        [{"name": "http", "port": 8000}, {"name": "launcher", "port": None}],
        [{"name": "http", "port": 8000}, {"name": "launcher", "port": True}],
    ):
        odd = endpoint_slice("s2", "llama", [endpoint("p0", "10.0.0.1")])
        odd["ports"] = ports
        assert [e.launcher_port for e in slice_endpoints(odd)] == [None], ports


def test_publish_pacing_bounds_the_share_spent_on_snapshots() -> None:
    pacing = PublishPacing(publish_cpu_share=0.1, min_publish_gap_s=0.05, max_publish_gap_s=1.0)
    assert pacing.wait_s(since_last_s=10.0, last_cost_s=0.02) == 0.0  # after a quiet spell: at once
    assert pacing.wait_s(since_last_s=0.0, last_cost_s=0.02) == pytest.approx(0.2)  # ten times its cost
    assert pacing.wait_s(since_last_s=0.15, last_cost_s=0.02) == pytest.approx(0.05)
    assert pacing.wait_s(since_last_s=0.0, last_cost_s=0.0001) == pytest.approx(0.05)  # the floor
    assert pacing.wait_s(since_last_s=0.0, last_cost_s=5.0) == pytest.approx(1.0)  # the ceiling
    with pytest.raises(ValueError, match="publish_cpu_share"):
        PublishPacing(publish_cpu_share=0)
    with pytest.raises(ValueError, match="min_publish_gap_s"):
        PublishPacing(min_publish_gap_s=2.0, max_publish_gap_s=1.0)


async def test_a_stream_of_events_becomes_a_few_snapshots_holding_them_all(free_port: int) -> None:
    """40 EndpointSlice changes in a burst: every endpoint reaches the fleet, in a few snapshots,
    not one each (a snapshot covers every model: at 1,000 models, one per event took most of a core)."""
    api = WatchApi()
    await api.start(free_port)
    for name in ("a", "b"):
        await api.put(IDS.format(ns="team"), deployment(name))
    pacing = PublishPacing(min_publish_gap_s=1.0, max_publish_gap_s=2.0)
    source = KubernetesReplicaSource(KubeClient.for_server(api.url), namespace="team", pacing=pacing)
    recorder = Recorder()
    await source.start(recorder)
    try:
        assert source.publishes == 1
        slices = [
            endpoint_slice(f"s-{i}", "a" if i % 2 else "b", [endpoint(f"p{i}", f"10.0.0.{i}")]) for i in range(40)
        ]
        started = asyncio.get_running_loop().time()
        for one in slices:  # a stream, each event seen on its own (a burst in one read coalesces anyway)
            await api.put(SLICES.format(ns="team"), one)
            await asyncio.sleep(0.01)
        took_s = asyncio.get_running_loop().time() - started
        await until(lambda: sum(len(v.endpoints) for v in recorder.last.values()) == 40, timeout_s=10)
        # One second apart at least, and the first at once: unpaced, about one per event.
        assert source.publishes <= 3 + took_s, (source.publishes, took_s)
        await asyncio.sleep(2.5)
        quiet = source.publishes
        # After a quiet spell a change is published (at once: the pure test above), in one snapshot.
        await api.put(SLICES.format(ns="team"), endpoint_slice("s-0", "b", []))
        await until(lambda: sum(len(v.endpoints) for v in recorder.last.values()) == 39, timeout_s=5)
        assert source.publishes == quiet + 1
    finally:
        await source.stop()
        await api.stop()
