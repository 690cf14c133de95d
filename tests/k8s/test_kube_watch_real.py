"""kvfleet.kube's watch against the real kube-apiserver: a clean end (its timeoutSeconds) resumes from
the last resourceVersion without a LIST, and a version older than the watch cache is 410 Gone and
one LIST. The client authenticates with the admin kubeconfig's client certificate.

Bookmarks are asked for on every watch here too, but kube-apiserver sent none within these 5-10 s
watches (it sends them about once a minute, and before a timeout only once its watch cache's
version has moved on), so their handling is proven on tests/support/watch_api.py instead
(tests/kube/test_watch.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from support.real_cluster import Kubectl

from kvfleet.devcluster.controlplane import ControlPlane
from kvfleet.kube.backoff import Backoff
from kvfleet.kube.client import KubeClient
from kvfleet.kube.watch import ObjectKey, ResourceWatch, WatchSettings

REPO = Path(__file__).resolve().parents[2]


def doc(name: str, namespace: str) -> dict[str, Any]:
    found = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    found["metadata"] = {"name": name, "namespace": namespace}
    return dict(found)


async def until(check: Any, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_watch_resumes_after_the_server_timeout_and_relists_only_on_gone(
    control_plane: ControlPlane, kubectl: Kubectl, crd_installed: None, namespace: str
) -> None:
    seen: list[tuple[str, bool]] = []

    def changed(key: ObjectKey, obj: Mapping[str, Any] | None) -> None:
        seen.append((key[1], obj is not None))

    async def scenario() -> None:
        async with KubeClient.from_kubeconfig(str(control_plane.kubeconfig)) as client:
            settings = WatchSettings(min_watch_timeout_s=5, backoff=Backoff(0.05, 0.5))
            path = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/inferencedeployments"
            watch = ResourceWatch(client, path, changed, settings=settings)
            await watch.sync()
            task = asyncio.create_task(watch.run())
            try:
                kubectl.apply(doc("one", namespace))
                await until(lambda: ("one", True) in seen, 20)
                # Several server-side timeouts (5-10 s each) pass: each resumes, none lists.
                await until(lambda: watch.stats.clean_ends >= 2, 40)
                kubectl.apply(doc("two", namespace))
                await until(lambda: ("two", True) in seen, 20)
                assert watch.stats.lists == 1
                # A version older than the API server's watch cache: 410 Gone, one LIST, and on.
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                watch.version = "1"
                kubectl("delete", "infd", "one", "-n", namespace)
                task = asyncio.create_task(watch.run())
                await until(lambda: watch.stats.gone == 1 and watch.synced, 30)
                await until(lambda: ("one", False) in seen, 20)
                assert watch.stats.lists == 2
                assert set(watch.store) == {(namespace, "two")}
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    asyncio.run(scenario())


def test_a_status_patch_with_a_stale_resource_version_is_refused(
    control_plane: ControlPlane, kubectl: Kubectl, crd_installed: None, namespace: str
) -> None:
    """The operator writes status planned from a watched copy with that copy's resourceVersion as a
    precondition (operator/reconcile.py): the real API server must refuse it once the object moved
    on (409, ``KubeConflict``), and accept it while the object is at that version."""
    from kvfleet.kube import KubeConflict
    from kvfleet.kube.ref import INFERENCE_DEPLOYMENTS as INFD

    async def scenario() -> None:
        async with KubeClient.from_kubeconfig(str(control_plane.kubeconfig)) as client:
            kubectl.apply(doc("pre", namespace))
            first = await client.get_object(INFD, namespace, "pre")
            assert first is not None
            seen = first["metadata"]["resourceVersion"]
            written = await client.patch_status(
                INFD, namespace, "pre", {"endpoint": "a"}, field_manager="test", resource_version=seen
            )
            assert written["status"]["endpoint"] == "a"
            try:
                await client.patch_status(
                    INFD, namespace, "pre", {"endpoint": "b"}, field_manager="test", resource_version=seen
                )
            except KubeConflict:
                pass
            else:
                raise AssertionError("a patch from a stale copy was written")
            now = await client.get_object(INFD, namespace, "pre")
            assert now is not None and now["status"]["endpoint"] == "a"

    asyncio.run(scenario())
