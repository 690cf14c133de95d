"""Replica discovery from Kubernetes: InferenceDeployments give served names and routing, EndpointSlices
labelled ``kvfleet.io/deployment`` give the replicas.

Two ``kvfleet.kube.ResourceWatch``es (list once, then watch with resourceVersion resume and
bookmarks; 410 Gone is the only relist) feed this source one changed object at a time. Only the
changed InferenceDeployment is validated again, and only the changed EndpointSlice is parsed; the
snapshot handed to the fleet is assembled from those cached parts (no validation) once per burst
of events, so a busy cluster costs the event loop that serves traffic little.

A snapshot covers every model (``Fleet.apply`` diffs them all), so its cost grows with the fleet:
~10-30 ms at 1,000 models. While events keep coming (1,000 deployments created or rolled at once, an
event every few milliseconds) a snapshot per event took most of a core per router
(docs/benchmarks/scale.md). So publishing is paced: an event after a quiet spell is published at
once; during a stream of events the next snapshot waits until ``publish_cpu_share`` of the time
since the last one went to publishing (at least ``min_publish_gap_s``, at most ``max_publish_gap_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from kvfleet.contracts import DEPLOYMENT_LABEL, ENGINE_HTTP_PORT_NAME, KV_EVENTS_PORT_NAME, LAUNCHER_PORT_NAME
from kvfleet.kube import KubeClient, Ref
from kvfleet.kube.backoff import Backoff
from kvfleet.kube.ref import INFERENCE_DEPLOYMENTS
from kvfleet.kube.watch import ObjectKey, ResourceWatch, WatchCollector, WatchSettings
from kvfleet.router.cold_start import NO_COLD_START, ColdStart, cold_start_of
from kvfleet.router.replicas import DeploymentView, Endpoint, FleetSink, NameConflict, Snapshot, resolve_claims
from kvfleet.served_names import created_unix_s
from kvfleet.spec import InferenceDeploymentSpec, RoutingSpec

log = logging.getLogger(__name__)

ENDPOINT_SLICES = Ref("discovery.k8s.io/v1", "endpointslices")

# The operator labels each engine Service with DEPLOYMENT_LABEL (EndpointSlices inherit it) and names
# its ports ENGINE_HTTP_PORT_NAME, LAUNCHER_PORT_NAME and, only where the engines publish events,
# KV_EVENTS_PORT_NAME.
PORT_NAME = ENGINE_HTTP_PORT_NAME


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = _meta(obj)
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


def _named_port(ports: list[Any], name: str) -> int | None:
    port = next((p.get("port") for p in ports if isinstance(p, Mapping) and p.get("name") == name), None)
    return port if isinstance(port, int) and not isinstance(port, bool) else None


def slice_endpoints(slice_obj: Mapping[str, Any]) -> list[Endpoint]:
    """The routable replicas in one EndpointSlice: ready ones, and serving-but-terminating ones as draining,
    each with the slice's ``kv-events`` port where its engines publish KV-cache events and its
    ``launcher`` port (where the router fetches the model's tokenizer files)."""
    ports = slice_obj.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == PORT_NAME), None)
    if port is None and ports:
        port = ports[0].get("port")
    if not isinstance(port, int):
        return []
    events_port, launcher_port = (_named_port(ports, name) for name in (KV_EVENTS_PORT_NAME, LAUNCHER_PORT_NAME))
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
            endpoints.append(
                Endpoint(
                    replica_id,
                    f"http://{host}:{port}",
                    draining=terminating,
                    kv_events_port=events_port,
                    launcher_port=launcher_port,
                )
            )
        except ValueError as e:
            log.warning("skipping endpoint %s in slice %s: %s", address, _key(slice_obj), e)
    return endpoints


@dataclass(frozen=True)
class ServedDeployment:
    """What the router needs of one valid InferenceDeployment (validated once per change)."""

    served_name: str
    routing: RoutingSpec
    created_unix_s: int | None = None
    cold_start: ColdStart = NO_COLD_START


def served_deployment(key: ObjectKey, obj: Mapping[str, Any]) -> ServedDeployment | None:
    """Validate one InferenceDeployment's spec; None (with a log line naming it) when invalid."""
    try:
        spec = InferenceDeploymentSpec.model_validate(obj.get("spec") or {})
    except ValidationError as e:
        log.warning("ignoring InferenceDeployment %s/%s with an invalid spec: %s", *key, e)
        return None
    # The cold start comes with the object the router watches anyway (docs/router.md, "Held through a
    # cold start"): no launcher to reach, no NetworkPolicy to open.
    estimate_s = spec.autoscaling.cold_start_seconds if spec.autoscaling is not None else None
    cold = cold_start_of(obj, estimate_s)
    return ServedDeployment(spec.served_name(key[1]), spec.routing, created_unix_s(obj), cold)


def slice_owner(key: ObjectKey, slice_obj: Mapping[str, Any]) -> ObjectKey | None:
    owner = (_meta(slice_obj).get("labels") or {}).get(DEPLOYMENT_LABEL)
    return (key[0], str(owner)) if owner else None


def merge_endpoints(slices: Mapping[ObjectKey, list[Endpoint]]) -> tuple[Endpoint, ...]:
    """One deployment's replicas over its slices: a replica in two slices counts once, ready over draining."""
    bucket: dict[str, Endpoint] = {}
    for key in sorted(slices):
        for endpoint in slices[key]:
            known = bucket.get(endpoint.replica_id)
            if known is None or (known.draining and not endpoint.draining):
                bucket[endpoint.replica_id] = endpoint
    return tuple(sorted(bucket.values(), key=lambda e: e.replica_id))


def view_of(key: ObjectKey, served: ServedDeployment, endpoints: tuple[Endpoint, ...]) -> DeploymentView:
    return DeploymentView(
        served.served_name, key[0], key[1], served.routing, endpoints, served.created_unix_s, served.cold_start
    )


def assemble(views: Mapping[ObjectKey, DeploymentView]) -> dict[str, DeploymentView]:
    """Model key -> view; two deployments serving one name: the older keeps it (pure; ``resolve_claims``)."""
    return resolve_claims(views.values())[0]


def log_new_conflicts(conflicts: list[NameConflict], logged: set[NameConflict]) -> set[NameConflict]:
    """Log each conflict once while it lasts; returns the conflicts now standing (the next call's ``logged``)."""
    for conflict in conflicts:
        if conflict not in logged:
            log.warning(
                "InferenceDeployment %s/%s is not routed: served name %r is already served by %s/%s "
                "(the older claimant)",
                *conflict.loser,
                conflict.served_name,
                *conflict.winner,
            )
    return set(conflicts)


def build_snapshot(
    deployments: Mapping[ObjectKey, Mapping[str, Any]], slices: Mapping[ObjectKey, Mapping[str, Any]]
) -> dict[str, DeploymentView]:
    """Model key -> deployment view from the InferenceDeployments and EndpointSlices seen (pure; the
    source computes the same thing incrementally)."""
    served = {key: one for key, obj in deployments.items() if (one := served_deployment(key, obj)) is not None}
    by_owner: dict[ObjectKey, dict[ObjectKey, list[Endpoint]]] = {}
    for key, slice_obj in slices.items():
        owner = slice_owner(key, slice_obj)
        if owner is not None:
            by_owner.setdefault(owner, {})[key] = slice_endpoints(slice_obj)
    return assemble({key: view_of(key, one, merge_endpoints(by_owner.get(key, {}))) for key, one in served.items()})


@dataclass(frozen=True)
class PublishPacing:
    """How often a stream of watch events may turn into a snapshot for the fleet."""

    publish_cpu_share: float = 0.1
    """At most this share of the router's time goes to publishing while events keep coming."""
    min_publish_gap_s: float = 0.05
    max_publish_gap_s: float = 1.0
    """An endpoint change reaches the fleet within this (plus one snapshot's cost), however big it is."""

    def __post_init__(self) -> None:
        if not 0 < self.publish_cpu_share <= 1:
            raise ValueError(f"publish_cpu_share must be in (0, 1], got {self.publish_cpu_share}")
        if not 0 <= self.min_publish_gap_s <= self.max_publish_gap_s <= 60:
            raise ValueError("need 0 <= min_publish_gap_s <= max_publish_gap_s <= 60")

    def wait_s(self, since_last_s: float, last_cost_s: float) -> float:
        """Pure: how long from now the next snapshot waits (0: publish at once). The gap after a
        snapshot that cost c is c / share (at 10%, ten times what it took), within the bounds."""
        gap_s = min(max(last_cost_s / self.publish_cpu_share, self.min_publish_gap_s), self.max_publish_gap_s)
        return max(0.0, gap_s - since_last_s)


class KubernetesReplicaSource:
    """Watches InferenceDeployments and their EndpointSlices (one namespace, or all when None)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        namespace: str | None = None,
        watch_timeout_s: int = 300,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        start_attempts: int = 8,
        pacing: PublishPacing | None = None,
    ) -> None:
        self._client = client
        self.pacing = pacing or PublishPacing()
        self._namespace = namespace
        settings = WatchSettings(
            min_watch_timeout_s=watch_timeout_s,
            backoff=Backoff(backoff_base_s, backoff_max_s),
            start_attempts=start_attempts,
        )
        self.deployments = ResourceWatch(
            client, INFERENCE_DEPLOYMENTS.collection(namespace), self._deployment_changed, settings=settings
        )
        self.slices = ResourceWatch(
            client,
            ENDPOINT_SLICES.collection(namespace),
            self._slice_changed,
            label_selector=DEPLOYMENT_LABEL,
            settings=settings,
        )
        self._served: dict[ObjectKey, ServedDeployment] = {}
        self._slice_owner: dict[ObjectKey, ObjectKey] = {}
        self._by_owner: dict[ObjectKey, dict[ObjectKey, list[Endpoint]]] = {}
        self._endpoints: dict[ObjectKey, tuple[Endpoint, ...]] = {}
        self._views: dict[ObjectKey, DeploymentView] = {}  # rebuilt per key when its parts change
        self.validations = 0
        """InferenceDeployment specs validated so far (one per change seen; tests and logs read it)."""
        self._conflicts: set[NameConflict] = set()  # logged while they stand
        self._sink: FleetSink | None = None
        self._publish_pending = False
        self._published_at = float("-inf")  # loop time of the last snapshot, and what it cost
        self._publish_cost_s = 0.0
        self.publishes = 0
        """Snapshots handed to the fleet so far (tests and logs read it)."""
        self._tasks: list[asyncio.Task[None]] = []

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """``kvfleet_router_kube_watch_total{resource, event}`` (the router server calls this)."""
        registry.register(WatchCollector("kvfleet_router_kube_watch", [self.deployments, self.slices]))

    def _deployment_changed(self, key: ObjectKey, obj: Mapping[str, Any] | None) -> None:
        self._served.pop(key, None)
        if obj is not None:
            self.validations += 1
            one = served_deployment(key, obj)
            if one is not None:
                self._served[key] = one
        self._refresh(key)
        self._schedule_publish()

    def _slice_changed(self, key: ObjectKey, obj: Mapping[str, Any] | None) -> None:
        old_owner = self._slice_owner.pop(key, None)
        if old_owner is not None:
            self._by_owner.get(old_owner, {}).pop(key, None)
        # The API server filters by label already; checking again keeps emulators and proxies honest.
        new_owner = slice_owner(key, obj) if obj is not None else None
        if obj is not None and new_owner is not None:
            self._slice_owner[key] = new_owner
            self._by_owner.setdefault(new_owner, {})[key] = slice_endpoints(obj)
        for owner in {old_owner, new_owner}:
            if owner is None:
                continue
            found = self._by_owner.get(owner)
            if found:
                self._endpoints[owner] = merge_endpoints(found)
            else:
                self._by_owner.pop(owner, None)
                self._endpoints.pop(owner, None)
            self._refresh(owner)
        self._schedule_publish()

    def _refresh(self, key: ObjectKey) -> None:
        served = self._served.get(key)
        if served is None:
            self._views.pop(key, None)
        else:
            self._views[key] = view_of(key, served, self._endpoints.get(key, ()))

    def _schedule_publish(self) -> None:
        """Coalesce a burst of events (a relist, a rollout) into one snapshot for the fleet."""
        if self._sink is None or self._publish_pending:
            return
        self._publish_pending = True
        loop = asyncio.get_running_loop()
        wait_s = self.pacing.wait_s(loop.time() - self._published_at, self._publish_cost_s)
        if wait_s > 0:
            loop.call_later(wait_s, self._publish)
        else:
            loop.call_soon(self._publish)

    def _publish(self) -> None:
        self._publish_pending = False
        if self._sink is not None:
            loop = asyncio.get_running_loop()
            started = loop.time()
            snapshot: Snapshot = self.snapshot()
            self._sink.apply(snapshot)
            self._published_at = loop.time()
            self._publish_cost_s = self._published_at - started
            self.publishes += 1

    def snapshot(self) -> dict[str, DeploymentView]:
        snapshot, conflicts = resolve_claims(self._views.values())
        self._conflicts = log_new_conflicts(conflicts, self._conflicts)
        return snapshot

    async def start(self, sink: FleetSink) -> None:
        for watch in (self.deployments, self.slices):
            await watch.sync()
        self._sink = sink
        self._publish()
        loop = asyncio.get_running_loop()
        for watch in (self.deployments, self.slices):
            self._tasks.append(loop.create_task(watch.run(), name=f"watch {watch.path}"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._sink = None
        await self._client.close()
