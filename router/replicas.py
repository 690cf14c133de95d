"""Replica discovery: what deployments exist and which of their replicas may take requests.

A ``ReplicaSource`` pushes whole snapshots (model key -> ``DeploymentView``) into a ``FleetSink``;
the fleet diffs them. Whole snapshots keep sources simple and make a missed event impossible: the
next snapshot is always the full truth. Two sources exist: ``StaticReplicaSource`` (local mode and
tests drive it with add / remove / mark_draining) and the Kubernetes one in ``kubernetes_source``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol
from urllib.parse import urlsplit

from kvfleet.router.cold_start import NO_COLD_START, ColdStart
from kvfleet.served_names import claim_order
from kvfleet.spec import RoutingSpec


@dataclass(frozen=True)
class Endpoint:
    """One replica: a stable id (pod name in Kubernetes), its base URL, and whether it is draining."""

    replica_id: str
    url: str
    draining: bool = False
    kv_capacity_blocks: int | None = None
    # Where its KV-cache events are published, when not the router's kv_events_port (several engines
    # on one host, as in local mode and tests).
    kv_events_port: int | None = None
    # Its launcher's port (Kubernetes: the EndpointSlice's launcher port), where the model's tokenizer
    # files are fetched from (tokenizer_fetch.py). None: unknown (static and local replicas).
    launcher_port: int | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"replica {self.replica_id!r}: url must be http(s)://host:port, got {self.url!r}")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"replica {self.replica_id!r}: url must have no path or query, got {self.url!r}")
        if not self.replica_id or len(self.replica_id) > 253:
            raise ValueError("replica_id must be 1-253 characters")
        for port in ("kv_events_port", "launcher_port"):
            value = getattr(self, port)
            if value is not None and not 1 <= value <= 65_535:
                raise ValueError(f"replica {self.replica_id!r}: {port} must be in [1, 65535]")


@dataclass(frozen=True)
class DeploymentView:
    """One served model: which InferenceDeployment it is (for the wake signal), routing, and replicas."""

    served_name: str
    namespace: str
    name: str
    routing: RoutingSpec
    endpoints: tuple[Endpoint, ...] = ()
    # When the deployment was created (Unix seconds; the InferenceDeployment's creationTimestamp
    # where the source knows it): the model object's ``created``, and who keeps a served name two
    # deployments claim (the older). None: the router's first sight.
    created_unix_s: int | None = None
    # Its cold start as discovery states it (estimate, pull progress): what a held client is told.
    cold_start: ColdStart = NO_COLD_START

    @property
    def key(self) -> str:
        """``namespace/served-name``: the model's identity across the cluster (a namespace has no slash)."""
        return model_key(self.namespace, self.served_name)

    @property
    def labels(self) -> tuple[str, str]:
        """(namespace, served name): the per-model metric labels."""
        return (self.namespace, self.served_name)


def model_key(namespace: str, served_name: str) -> str:
    return f"{namespace}/{served_name}"


def key_labels(key: str) -> tuple[str, str]:
    """(namespace, served name) of a model key: a namespace holds no slash, a served name may."""
    namespace, _, served_name = key.partition("/")
    return (namespace, served_name)


@dataclass(frozen=True)
class NameConflict:
    """A served name two deployments claim: ``loser`` is not routed; ``winner`` keeps the name."""

    served_name: str
    winner: tuple[str, str]  # (namespace, name)
    loser: tuple[str, str]


def _claim_order(view: DeploymentView) -> tuple[float, str, str]:
    return claim_order(view.created_unix_s, view.namespace, view.name)


def resolve_claims(views: Iterable[DeploymentView]) -> tuple[dict[str, DeploymentView], list[NameConflict]]:
    """Model key -> view, one per served name: the oldest claimant (creationTimestamp; ties by
    namespace/name) keeps it, so a newer deployment in an earlier-sorting namespace cannot take its
    traffic. The others are returned as conflicts and are not routed (pure)."""
    snapshot: dict[str, DeploymentView] = {}
    owners: dict[str, DeploymentView] = {}
    conflicts: list[NameConflict] = []
    for view in sorted(views, key=_claim_order):
        owner = owners.get(view.served_name)
        if owner is not None:
            conflicts.append(NameConflict(view.served_name, (owner.namespace, owner.name), (view.namespace, view.name)))
            continue
        owners[view.served_name] = view
        snapshot[view.key] = view
    return snapshot, conflicts


Snapshot = Mapping[str, DeploymentView]


class FleetSink(Protocol):
    def apply(self, snapshot: Snapshot) -> None:
        """Replace the known deployments and replicas with ``snapshot`` (keyed by ``DeploymentView.key``;
        one view per served name)."""


class ReplicaSource(Protocol):
    async def start(self, sink: FleetSink) -> None:
        """Begin feeding ``sink``; returns once the first snapshot has been applied."""

    async def stop(self) -> None:
        """Stop feeding; idempotent."""


class StaticReplicaSource:
    """Deployments and replicas set by the caller (local mode's process actuator, tests, the CLI)."""

    def __init__(self, deployments: Iterable[DeploymentView] = ()) -> None:
        self._deployments: dict[str, DeploymentView] = {d.served_name: d for d in deployments}
        self._sink: FleetSink | None = None

    async def start(self, sink: FleetSink) -> None:
        self._sink = sink
        self._publish()

    async def stop(self) -> None:
        self._sink = None

    def snapshot(self) -> dict[str, DeploymentView]:
        return {view.key: view for view in self._deployments.values()}

    def set_deployment(
        self,
        served_name: str,
        *,
        routing: RoutingSpec | None = None,
        namespace: str = "default",
        name: str | None = None,
        cold_start: ColdStart | None = None,
    ) -> None:
        """Declare (or update) a served model; its replicas are kept."""
        current = self._deployments.get(served_name)
        self._deployments[served_name] = DeploymentView(
            served_name=served_name,
            namespace=namespace,
            name=name or served_name,
            routing=routing or (current.routing if current else RoutingSpec()),
            endpoints=current.endpoints if current else (),
            cold_start=cold_start or (current.cold_start if current else NO_COLD_START),
        )
        self._publish()

    def remove_deployment(self, served_name: str) -> None:
        self._deployments.pop(served_name, None)
        self._publish()

    def add(
        self,
        served_name: str,
        replica_id: str,
        url: str,
        *,
        kv_capacity_blocks: int | None = None,
        kv_events_port: int | None = None,
        launcher_port: int | None = None,
    ) -> None:
        """Add a ready replica (declaring the deployment with default routing if it is new)."""
        endpoint = Endpoint(
            replica_id,
            url,
            kv_capacity_blocks=kv_capacity_blocks,
            kv_events_port=kv_events_port,
            launcher_port=launcher_port,
        )
        deployment = self._deployments.get(served_name)
        if deployment is None:
            deployment = DeploymentView(served_name, "default", served_name, RoutingSpec())
        others = tuple(e for e in deployment.endpoints if e.replica_id != replica_id)
        self._deployments[served_name] = replace(deployment, endpoints=(*others, endpoint))
        self._publish()

    def remove(self, served_name: str, replica_id: str) -> None:
        deployment = self._deployments.get(served_name)
        if deployment is None:
            return
        endpoints = tuple(e for e in deployment.endpoints if e.replica_id != replica_id)
        self._deployments[served_name] = replace(deployment, endpoints=endpoints)
        self._publish()

    def mark_draining(self, served_name: str, replica_id: str, draining: bool = True) -> None:
        """A draining replica takes no new requests; its in-flight requests finish."""
        deployment = self._deployments.get(served_name)
        if deployment is None:
            raise KeyError(f"unknown deployment {served_name!r}")
        if not any(e.replica_id == replica_id for e in deployment.endpoints):
            raise KeyError(f"deployment {served_name!r} has no replica {replica_id!r}")
        endpoints = tuple(
            replace(e, draining=draining) if e.replica_id == replica_id else e for e in deployment.endpoints
        )
        self._deployments[served_name] = replace(deployment, endpoints=endpoints)
        self._publish()

    def _publish(self) -> None:
        if self._sink is not None:
            self._sink.apply(self.snapshot())
