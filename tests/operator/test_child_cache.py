"""The operator's child cache (operator/child_cache.py) against KMock's API emulator: reads before the
first LIST go to the server, after it they are answered from the watch with no request; the
operator's own writes are read back until the watch has them; a deletion seen by the watch wins."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.kube import KubeClient, Ref
from kvfleet.operator.child_cache import CACHE_SELECTOR, ChildCache, parse_selector, typed
from kvfleet_testkit.kube_emulator import Cluster, eventually

NS = "default"
CONFIGMAPS = Ref("v1", "configmaps")
PODS = Ref("v1", "pods")
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
LABELS = {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.io/deployment": "m"}


def configmap(name: str, labels: dict[str, str] | None = None) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": labels if labels is not None else LABELS},
        "data": {"k": "v"},
    }


def requests_since(cluster: Cluster, start: int) -> list[str]:
    return [f"{r.method.value} {r.resource} {r.name}" for r in list(cluster.api)[start:]]


async def test_reads_come_from_the_watch_once_it_has_listed(cluster: Cluster) -> None:
    await cluster.call("POST", f"/api/v1/namespaces/{NS}/configmaps", configmap("m-engine-spec"))
    async with KubeClient.for_server(cluster.url, timeout_s=5) as client:
        cache = ChildCache(client, (CONFIGMAPS, PODS))
        # Not started: a read goes to the API server (never a stale "missing").
        before = len(list(cluster.api))
        assert await cache.get_object(CONFIGMAPS, NS, "m-engine-spec") is not None
        assert len(requests_since(cluster, before)) == 1
        cache.start()
        try:
            await eventually(lambda: cache.synced, what="the cache's first LIST")
            await asyncio.sleep(0.2)
            before = len(list(cluster.api))
            found = await cache.get_object(CONFIGMAPS, NS, "m-engine-spec")
            assert found is not None and found["data"] == {"k": "v"}
            # Listed before the watch began: typed as a single GET would be (a real LIST's items are
            # not), so it compares equal to its rendering.
            assert (found["apiVersion"], found["kind"]) == ("v1", "ConfigMap")
            assert await cache.get_object(CONFIGMAPS, NS, "absent") is None
            assert await cache.list_objects(PODS, NS, ",".join(f"{k}={v}" for k, v in LABELS.items())) == []
            assert requests_since(cluster, before) == []
            # A selector that does not imply the cache's own is asked of the server.
            await cache.list_objects(PODS, NS, "kvfleet.io/deployment=m")
            assert len(requests_since(cluster, before)) == 1
        finally:
            await cache.stop()


async def test_own_write_is_read_back_until_a_deletion_is_seen(cluster: Cluster) -> None:
    async with KubeClient.for_server(cluster.url, timeout_s=5) as client:
        cache = ChildCache(client, (CONFIGMAPS,))
        cache.start()
        try:
            await eventually(lambda: cache.synced, what="the cache's first LIST")
            applied = await client.apply(CONFIGMAPS, configmap("m-engine-pin"), field_manager="test")
            cache.remember(CONFIGMAPS, applied)
            # Read back at once, whether or not the watch has delivered it yet.
            assert await cache.get_object(CONFIGMAPS, NS, "m-engine-pin") is not None
            await cluster.delete(f"/api/v1/namespaces/{NS}/configmaps/m-engine-pin")

            async def gone() -> bool:
                return await cache.get_object(CONFIGMAPS, NS, "m-engine-pin") is None

            deadline = asyncio.get_running_loop().time() + 10
            while not await gone():
                assert asyncio.get_running_loop().time() < deadline, "the deletion never reached the cache"
                await asyncio.sleep(0.05)
        finally:
            await cache.stop()


def test_only_equality_selectors_are_parsed() -> None:
    assert parse_selector(CACHE_SELECTOR) == {"app.kubernetes.io/name": "kvfleet-engine"}
    with pytest.raises(ValueError, match="equality"):
        parse_selector("tier in (a,b)")


def test_list_items_get_their_api_version_and_kind_back() -> None:
    listed = {"metadata": {"name": "m-engine", "namespace": NS}, "spec": {}}  # as a LIST's item
    assert typed(Ref("apps/v1", "deployments"), listed) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        **listed,
    }
    assert "apiVersion" not in listed  # a copy: the store keeps what the server sent


async def test_the_cache_keeps_no_managed_fields_and_no_pod_spec(cluster: Cluster) -> None:
    """What the reconciler never reads is not held: at 3,000 pods, most of their weight."""
    managed = [{"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:data": {}}}]
    cm = configmap("m-engine-spec")
    cm["metadata"]["managedFields"] = managed  # type: ignore[index]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "m-engine-0", "namespace": NS, "labels": LABELS, "managedFields": managed},
        "spec": {"containers": [{"name": "engine", "image": "engine", "env": [{"name": "A", "value": "1"}]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }
    await cluster.call("POST", f"/api/v1/namespaces/{NS}/configmaps", cm)
    await cluster.call("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    async with KubeClient.for_server(cluster.url, timeout_s=5) as client:
        cache = ChildCache(client, (CONFIGMAPS, PODS))
        cache.start()
        try:
            await eventually(lambda: cache.synced, what="the cache's first LIST")
            found = await cache.get_object(CONFIGMAPS, NS, "m-engine-spec")
            assert found is not None and found["data"] == {"k": "v"}
            assert "managedFields" not in found["metadata"]
            pods = await cache.list_objects(PODS, NS, ",".join(f"{k}={v}" for k, v in LABELS.items()))
            assert [p["metadata"]["name"] for p in pods] == ["m-engine-0"]
            assert "spec" not in pods[0] and "managedFields" not in pods[0]["metadata"]
            assert pods[0]["status"]["podIP"] == "10.0.0.1" and pods[0]["metadata"]["labels"] == LABELS
            # A change seen by the watch is stored the same way.
            await cluster.call(
                "PATCH",
                f"/api/v1/namespaces/{NS}/configmaps/m-engine-spec",
                {"data": {"k": "w"}},
                content_type="application/merge-patch+json",
            )
            await eventually(
                lambda: cache.watches[CONFIGMAPS][None].store[(NS, "m-engine-spec")].get("data") == {"k": "w"},
                what="the change in the cache",
            )
            changed = cache.watches[CONFIGMAPS][None].store[(NS, "m-engine-spec")]
            assert "managedFields" not in changed["metadata"]
            # A list reads its namespace's names (kept from the watch's changes): a pod of another
            # namespace is not in it, and a deleted pod leaves it.
            other = {**pod, "metadata": {**pod["metadata"], "namespace": "elsewhere"}}
            await cluster.call("POST", "/api/v1/namespaces/elsewhere/pods", other)
            await cluster.call("DELETE", f"/api/v1/namespaces/{NS}/pods/m-engine-0")
            selector = ",".join(f"{k}={v}" for k, v in LABELS.items())
            await eventually(lambda: (NS, "m-engine-0") not in cache.watches[PODS][None].store, what="the deletion")
            assert await cache.list_objects(PODS, NS, selector) == []
            assert [p["metadata"]["name"] for p in await cache.list_objects(PODS, "elsewhere", selector)] == [
                "m-engine-0"
            ]
        finally:
            await cache.stop()
