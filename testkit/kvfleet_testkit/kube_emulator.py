"""KMock's Kubernetes API emulator, extended for the kopf operator's tests (tests/operator) and its
resync benchmark (bench/operator_resync.py).

KMock's emulator is deliberately simple (dict merges). ``ApiEmulator`` adds, in a few lines each,
only the API semantics the operator relies on; the real semantics are left to tests/e2e:

1. A server-side apply PATCH (``application/apply-patch+yaml``) of a missing object creates it;
   of an existing one it is KMock's plain merge (real SSA would also drop fields the manager no
   longer sets; the operator never relies on that).
2. Created objects get ``uid``, ``resourceVersion``, ``creationTimestamp`` and ``generation: 1``
   (kopf.adopt and kopf's finalizer patches need the first two).
3. A patch that changes ``spec`` bumps ``metadata.generation`` (observedGeneration relies on it).
4. ``labelSelector`` on list calls filters by equality (``a=b,c=d``), as the operator lists pods so.
5. ``metadata.generateName`` on create gets a random suffix (kopf names its Events so).
6. Every create and patch gives the object the next ``resourceVersion`` of one counter, as etcd's
   revision does (the operator tells its own writes from older watched copies by it).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import kmock

from kvfleet.kube import server_config
from kvfleet.operator.runner import run_operator
from kvfleet.operator.settings import OperatorSettings

from .kmock_resources import register_inference_deployments

INFD = kmock.resource("kvfleet.io", "v1alpha1", "inferencedeployments")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
SERVICES = kmock.resource("", "v1", "services")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
PODS = kmock.resource("", "v1", "pods")
EVENTS = kmock.resource("", "v1", "events")
SERVICE_MONITORS = kmock.resource("monitoring.coreos.com", "v1", "servicemonitors")
PEERINGS = kmock.resource("kopf.dev", "v1", "clusterkopfpeerings")
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(base.get(key), value)
    return out


def _fill_metadata(obj: dict[str, Any], version: str = "1") -> None:
    meta = obj.setdefault("metadata", {})
    if "name" not in meta and "generateName" in meta:
        meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
    meta.setdefault("uid", str(uuid.uuid4()))
    meta["resourceVersion"] = version
    meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    meta.setdefault("generation", 1)


class ApiEmulator(kmock.KubernetesEmulator):
    """KMock plus the six API semantics listed in this module's docstring."""

    def _next_version(self) -> str:
        self._revision: int = getattr(self, "_revision", 0) + 1
        return str(self._revision)

    def _stored(self, request: kmock.Request) -> Any:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key]
        return None

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        content_type = request.headers.get("Content-Type", "")
        if request.resource is not None and isinstance(request.data, dict):
            if request.method == "POST":
                _fill_metadata(request.data, self._next_version())
            elif request.method == "PATCH" and request.name is not None and self._stored(request) is not None:
                request.data.setdefault("metadata", {})["resourceVersion"] = self._next_version()
            if request.method == "PATCH" and request.name is not None and request.subresource is None:
                stored = self._stored(request)
                if stored is None and content_type.startswith("application/apply-patch"):
                    obj = copy.deepcopy(request.data)
                    _fill_metadata(obj, self._next_version())
                    key = (request.resource, request.namespace, request.name)
                    self.objects[key] = obj
                    await self._buses[request.resource].put({"type": "ADDED", "object": obj})
                    return aiohttp.web.json_response(obj, status=201)
                if stored is not None and "spec" in request.data:
                    old = stored.raw
                    if _merge(old.get("spec"), request.data["spec"]) != old.get("spec"):
                        generation = int(old.get("metadata", {}).get("generation") or 1) + 1
                        request.data.setdefault("metadata", {})["generation"] = generation
        return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            wanted = dict(part.split("=", 1) for part in selector.split(","))
            result["items"] = [
                item
                for item in result["items"]
                if all((item.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in wanted.items())
            ]
        return result


@dataclass
class Cluster:
    """The emulator, its URL, and helpers that act like kubectl and the Deployment controller."""

    api: ApiEmulator
    url: str
    http: aiohttp.ClientSession

    def writes(self, user_agent: str = "kvfleet") -> list[kmock.Request]:
        """Write requests sent by the operator (our client and kopf: both identify themselves)."""
        return [
            r
            for r in list(self.api)
            if r.method.value in WRITE_METHODS
            and (user_agent in r.headers.get("User-Agent", "") or "kopf" in r.headers.get("User-Agent", ""))
        ]

    def get(self, resource: Any, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key in self.api.objects and not self.api.objects[key].deleted:
            return copy.deepcopy(self.api.objects[key].raw)
        return None

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        headers = {"Content-Type": content_type, "User-Agent": "test-kubectl"}
        async with self.http.request(method, self.url + path, json=body, headers=headers) as response:
            assert response.status < 400, await response.text()
            return await response.json()

    async def create_infd(self, doc: dict[str, Any]) -> dict[str, Any]:
        ns = doc["metadata"].get("namespace", "default")
        return await self.call("POST", f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/inferencedeployments", doc)

    async def patch_infd(self, ns: str, name: str, patch: dict[str, Any], subresource: str = "") -> Any:
        path = f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/inferencedeployments/{name}"
        return await self.call(
            "PATCH", path + (f"/{subresource}" if subresource else ""), patch, "application/merge-patch+json"
        )

    async def delete(self, path: str) -> Any:
        return await self.call("DELETE", path)

    async def roll_out(self, ns: str, name: str, ready: int) -> None:
        """Play the Deployment controller: report ``ready`` replicas of the current template."""
        dep = self.get(DEPLOYMENTS, ns, f"{name}-engine")
        assert dep is not None
        status = {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": ready,
            "updatedReplicas": ready,
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        await self.call(
            "PATCH",
            f"/apis/apps/v1/namespaces/{ns}/deployments/{name}-engine/status",
            {"status": status},
            "application/merge-patch+json",
        )


async def eventually(check: Callable[[], Any], timeout_s: float = 15.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns a truthy value (bounded; the operator works asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def operator_settings(**overrides: Any) -> OperatorSettings:
    values: dict[str, Any] = {"resync_interval_s": 0.5, "retry_delay_s": 0.5, "api_timeout_s": 5.0}
    values.update(overrides)
    return OperatorSettings(**values)


@dataclass
class RunningOperator:
    """The operator on its own thread and event loop.

    kopf cancels every task created after its start when it stops (it cannot tell its own tasks
    from others), which would include the test's and KMock's; a separate loop keeps them apart.
    """

    settings: OperatorSettings
    thread: threading.Thread
    stop: threading.Event
    errors: list[BaseException]


async def start_operator(cluster: Cluster, settings: OperatorSettings) -> RunningOperator:
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    config = server_config(cluster.url)

    def main() -> None:
        try:
            asyncio.run(run_operator(settings, config=config, stop_flag=stop, ready_flag=ready))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=main, name="kvfleet-operator", daemon=True)
    thread.start()
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, ready.wait, 15), "the operator did not start"
    return RunningOperator(settings, thread, stop, errors)


async def stop_operator(running: RunningOperator) -> None:
    running.stop.set()
    await asyncio.get_running_loop().run_in_executor(None, running.thread.join, 20)
    assert not running.thread.is_alive(), "the operator did not stop"
    assert not running.errors, running.errors


async def serve_cluster() -> AsyncIterator[Cluster]:
    """An emulator with the InferenceDeployment resource registered, on a free loopback port."""
    api = ApiEmulator()
    register_inference_deployments(api, subresources=("status", "scale"))
    async with api, kmock.Server(api) as server, aiohttp.ClientSession() as http:
        yield Cluster(api, str(server.url).rstrip("/"), http)
