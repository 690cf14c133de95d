"""Replica discovery from Kubernetes: InferenceDeployments give served names and routing, EndpointSlices
labelled ``kvfleet.io/deployment`` give the replicas.

List, then watch from the list's resourceVersion; on a broken watch or 410 Gone, list again after a
bounded back-off. Every change rebuilds the whole snapshot from the two stores (``build_snapshot``, a
pure function), so a missed event can never leave a stale replica behind.

Hand-written over aiohttp rather than the ``kubernetes`` client: that client is synchronous (its
watch would pin a thread per stream and cannot be cancelled cleanly); it is still used to read
kubeconfig files (``KubeApi.from_kubeconfig``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError

from kvfleet.router.replicas import DeploymentView, Endpoint, FleetSink, Snapshot
from kvfleet.spec import GROUP, PLURAL, VERSION, InferenceDeploymentSpec

log = logging.getLogger(__name__)

DEPLOYMENT_LABEL = "kvfleet.io/deployment"
PORT_NAME = "http"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ObjectKey = tuple[str, str]  # (namespace, name)


class KubeApiError(Exception):
    """The API server could not be reached or refused a list or watch; ``status`` is the HTTP status
    (None when no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        """No answer, 429 (load shedding, storage initializing) or 5xx; a 401/403/404 will not heal."""
        return self.status is None or self.status == 429 or self.status >= 500


@dataclass(frozen=True)
class KubeApi:
    """How to reach the API server. The token is read from ``token_file`` on each (re)connect, so a
    rotated service-account token is picked up, and it is never logged."""

    server: str
    token_file: Path | None = None
    ca_file: Path | None = None
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    insecure: bool = False

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubeApiError("not in a cluster: KUBERNETES_SERVICE_HOST/PORT are not set")
        host = f"[{host}]" if ":" in host else host
        return cls(
            server=f"https://{host}:{port}",
            token_file=SERVICE_ACCOUNT_DIR / "token",
            ca_file=SERVICE_ACCOUNT_DIR / "ca.crt",
        )

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None) -> KubeApi:
        from kubernetes import client, config  # only when asked: a slow import

        configuration = client.Configuration()
        config.load_kube_config(config_file=path, context=context, client_configuration=configuration)
        token_file = _kubeconfig_token_file(path, context)
        if token_file is not None:
            # A token by reference (a projected or `kubectl create token` file), re-read per connect.
            return cls(
                server=configuration.host,
                token_file=token_file,
                ca_file=Path(configuration.ssl_ca_cert) if configuration.ssl_ca_cert else None,
                insecure=not configuration.verify_ssl,
            )
        if configuration.get_api_key_with_prefix("BearerToken", alias="authorization"):
            # A kubeconfig token is inline: this object holds secrets only by file reference. In a
            # cluster the router uses its service account; outside, a client certificate.
            raise KubeApiError(
                "an inline kubeconfig token is not supported here (secrets by reference only); "
                "use tokenFile, a client certificate, or in-cluster credentials"
            )
        return cls(
            server=configuration.host,
            ca_file=Path(configuration.ssl_ca_cert) if configuration.ssl_ca_cert else None,
            client_cert_file=Path(configuration.cert_file) if configuration.cert_file else None,
            client_key_file=Path(configuration.key_file) if configuration.key_file else None,
            insecure=not configuration.verify_ssl,
        )

    def headers(self) -> dict[str, str]:
        if self.token_file is None:
            return {}
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.client_cert_file:
            context.load_cert_chain(str(self.client_cert_file), str(self.client_key_file or self.client_cert_file))
        return context


def _kubeconfig_token_file(path: str | None, context: str | None) -> Path | None:
    """The current user's ``tokenFile`` in a kubeconfig, if it names one (relative to the file)."""
    import yaml

    config_path = Path(path or os.environ.get("KUBECONFIG", "") or Path.home() / ".kube" / "config")
    try:
        doc = yaml.safe_load(config_path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    name = context or doc.get("current-context")
    ctx = next((c.get("context") or {} for c in doc.get("contexts") or [] if c.get("name") == name), {})
    user = next((u.get("user") or {} for u in doc.get("users") or [] if u.get("name") == ctx.get("user")), {})
    token_file = user.get("tokenFile")
    if not token_file:
        return None
    return (config_path.parent / token_file).resolve()


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = _meta(obj)
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


def slice_endpoints(slice_obj: Mapping[str, Any]) -> list[Endpoint]:
    """The routable replicas in one EndpointSlice: ready ones, and serving-but-terminating ones as draining."""
    ports = slice_obj.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == PORT_NAME), None)
    if port is None and ports:
        port = ports[0].get("port")
    if not isinstance(port, int):
        return []
    endpoints: list[Endpoint] = []
    for ep in slice_obj.get("endpoints") or []:
        addresses = ep.get("addresses") or []
        if not addresses:
            continue
        conditions = ep.get("conditions") or {}
        terminating = conditions.get("terminating") is True
        # Kubernetes: a nil ready/serving is to be read as true.
        ready = conditions.get("ready") is not False
        serving = conditions.get("serving", ready) is not False
        if terminating and not serving:
            continue
        if not terminating and not ready:
            continue
        address = str(addresses[0])
        host = f"[{address}]" if ":" in address else address
        target = ep.get("targetRef") or {}
        replica_id = str(target.get("name") or address)
        try:
            endpoints.append(Endpoint(replica_id, f"http://{host}:{port}", draining=terminating))
        except ValueError as e:
            log.warning("skipping endpoint %s in slice %s: %s", address, _key(slice_obj), e)
    return endpoints


def build_snapshot(
    deployments: Mapping[ObjectKey, Mapping[str, Any]], slices: Mapping[ObjectKey, Mapping[str, Any]]
) -> dict[str, DeploymentView]:
    """Served name -> deployment view from the InferenceDeployments and EndpointSlices seen (pure)."""
    endpoints_by_deployment: dict[ObjectKey, dict[str, Endpoint]] = {}
    for (namespace, _), slice_obj in slices.items():
        owner = (_meta(slice_obj).get("labels") or {}).get(DEPLOYMENT_LABEL)
        if not owner:
            continue
        bucket = endpoints_by_deployment.setdefault((namespace, str(owner)), {})
        for endpoint in slice_endpoints(slice_obj):
            known = bucket.get(endpoint.replica_id)
            if known is None or (known.draining and not endpoint.draining):
                bucket[endpoint.replica_id] = endpoint
    snapshot: dict[str, DeploymentView] = {}
    for key in sorted(deployments):
        namespace, name = key
        try:
            spec = InferenceDeploymentSpec.model_validate(deployments[key].get("spec") or {})
        except ValidationError as e:
            log.warning("ignoring InferenceDeployment %s/%s with an invalid spec: %s", namespace, name, e)
            continue
        served = spec.served_name(name)
        if served in snapshot:
            other = snapshot[served]
            log.warning(
                "InferenceDeployment %s/%s serves %r, already served by %s/%s; the first (by namespace/name) wins",
                namespace,
                name,
                served,
                other.namespace,
                other.name,
            )
            continue
        endpoints = tuple(sorted(endpoints_by_deployment.get(key, {}).values(), key=lambda e: e.replica_id))
        snapshot[served] = DeploymentView(served, namespace, name, spec.routing, endpoints)
    return snapshot


class KubernetesReplicaSource:
    """Watches InferenceDeployments and their EndpointSlices (one namespace, or all when None)."""

    def __init__(
        self,
        api: KubeApi,
        *,
        namespace: str | None = None,
        request_timeout_s: float = 30.0,
        watch_timeout_s: int = 300,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        start_attempts: int = 8,
    ) -> None:
        self._api = api
        self._start_attempts = max(1, start_attempts)
        self._namespace = namespace
        self._request_timeout_s = request_timeout_s
        self._watch_timeout_s = watch_timeout_s
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._deployments: dict[ObjectKey, Mapping[str, Any]] = {}
        self._slices: dict[ObjectKey, Mapping[str, Any]] = {}
        self._sink: FleetSink | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _path(self, kind: str) -> str:
        ns = f"/namespaces/{self._namespace}" if self._namespace else ""
        if kind == "deployments":
            return f"/apis/{GROUP}/{VERSION}{ns}/{PLURAL}"
        return f"/apis/discovery.k8s.io/v1{ns}/endpointslices"

    def _store(self, kind: str) -> dict[ObjectKey, Mapping[str, Any]]:
        return self._deployments if kind == "deployments" else self._slices

    def _params(self, kind: str) -> dict[str, str]:
        return {"labelSelector": DEPLOYMENT_LABEL} if kind == "slices" else {}

    async def start(self, sink: FleetSink) -> None:
        self._sink = sink
        # read_bufsize bounds one watch event line; 2 MiB is far above a large EndpointSlice.
        self._session = aiohttp.ClientSession(base_url=self._api.server, read_bufsize=2**21)
        versions = {}
        for kind in ("deployments", "slices"):
            versions[kind] = await self._first_list(kind)
        self._publish()
        for kind in ("deployments", "slices"):
            self._tasks.append(asyncio.get_running_loop().create_task(self._watch_forever(kind, versions[kind])))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._sink = None

    def snapshot(self) -> dict[str, DeploymentView]:
        return build_snapshot(self._deployments, self._slices)

    def _publish(self) -> None:
        if self._sink is not None:
            snapshot: Snapshot = self.snapshot()
            self._sink.apply(snapshot)

    async def _list(self, kind: str) -> str:
        assert self._session is not None
        try:
            async with self._session.get(
                self._path(kind),
                params=self._params(kind),
                headers=self._api.headers(),
                ssl=self._api.ssl_context(),
                timeout=aiohttp.ClientTimeout(total=self._request_timeout_s),
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise KubeApiError(f"list {self._path(kind)}: HTTP {resp.status}: {text}", resp.status)
                body = await resp.json()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            raise KubeApiError(f"list {self._path(kind)}: {e!r}") from e
        store = self._store(kind)
        store.clear()
        for item in body.get("items") or []:
            if self._wanted(kind, item):
                store[_key(item)] = item
        return str(_meta(body).get("resourceVersion", ""))

    async def _first_list(self, kind: str) -> str:
        """The start-up list, retried: a 429 ("storage is (re)initializing" right after a CRD is
        created, or API priority and fairness shedding load) or a restarting API server must not
        kill the router. Bounded by ``start_attempts``; jittered so a fleet of routers spreads out."""
        backoff_s = self._backoff_base_s
        for attempt in range(1, self._start_attempts + 1):
            try:
                return await self._list(kind)
            except KubeApiError as e:
                if attempt == self._start_attempts or not e.retryable:
                    raise
                wait_s = random.uniform(backoff_s / 2, backoff_s)  # noqa: S311 (jitter, not secrets)
                log.warning(
                    "list %s (attempt %d/%d): %s; again in %.1fs", kind, attempt, self._start_attempts, e, wait_s
                )
                await asyncio.sleep(wait_s)
                backoff_s = min(self._backoff_max_s, backoff_s * 2)
        raise AssertionError("unreachable")

    def _wanted(self, kind: str, obj: Mapping[str, Any]) -> bool:
        # The API server filters by label already; checking again keeps emulators and proxies honest.
        return kind == "deployments" or DEPLOYMENT_LABEL in (_meta(obj).get("labels") or {})

    async def _watch_forever(self, kind: str, version: str) -> None:
        backoff_s = self._backoff_base_s
        while True:
            try:
                await self._watch_once(kind, version)
                backoff_s = self._backoff_base_s  # a clean server-side timeout: resume at once
            except KubeApiError as e:
                log.warning("watch %s: %s; listing again in %.1fs", kind, e, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(self._backoff_max_s, backoff_s * 2)
            try:
                version = await self._list(kind)
                self._publish()
            except KubeApiError as e:
                log.warning("relist %s: %s", kind, e)
                version = ""

    async def _watch_once(self, kind: str, version: str) -> None:
        assert self._session is not None
        params = {**self._params(kind), "watch": "1", "timeoutSeconds": str(self._watch_timeout_s)}
        params["allowWatchBookmarks"] = "true"
        if version:
            params["resourceVersion"] = version
        store = self._store(kind)
        try:
            async with self._session.get(
                self._path(kind),
                params=params,
                headers=self._api.headers(),
                ssl=self._api.ssl_context(),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self._request_timeout_s, sock_read=self._watch_timeout_s + 30
                ),
            ) as resp:
                if resp.status == 410:
                    raise KubeApiError("resourceVersion expired (410 Gone)")
                if resp.status != 200:
                    raise KubeApiError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind_of_event, obj = event.get("type"), event.get("object") or {}
                    if kind_of_event == "ERROR":
                        raise KubeApiError(f"watch error event: {obj.get('message', obj)}")
                    if kind_of_event == "BOOKMARK" or not self._wanted(kind, obj):
                        continue
                    if kind_of_event == "DELETED":
                        store.pop(_key(obj), None)
                    elif kind_of_event in ("ADDED", "MODIFIED"):
                        store[_key(obj)] = obj
                    self._publish()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as e:
            raise KubeApiError(f"watch {self._path(kind)}: {e!r}") from e
