"""The operator's read cache of its children and engine pods: one list-then-watch per kind
(``kvfleet.kube.watch.ResourceWatch``), so a reconcile that finds nothing to change sends no request.

Why: every reconcile reads the engine Deployment, both ConfigMaps, the Service, the PDB and (while
a deployment is not ready, or to learn its cold start) its pods. Read by GET, a resync of 1,000
converged deployments every 30 s cost ~14,000 requests a minute; read from watches that the API
server feeds only with changes, it costs none (docs/benchmarks/scale.md).

Reads of a kind whose watch has not listed yet (start-up, after a 410 until the relist) go to the
API server, so the cache is never a reason to act on a stale "missing". Pods are kept without their
spec and nothing keeps its managedFields: the reconciler reads neither, and they are most of what
3,000 pods weigh in memory. Objects the operator has just applied are remembered until the watch
delivers them or a newer version, so the next reconcile does not see its own write as drift.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvfleet.contracts import APP_NAME_LABEL, ENGINE_APP
from kvfleet.kube import KubeClient, Ref
from kvfleet.kube.watch import (
    ObjectKey,
    OnChange,
    ResourceWatch,
    WatchSettings,
    keep_pod_status,
    resource_version,
    without_managed_fields,
)

log = logging.getLogger(__name__)

# Every child and every engine pod carries this label (kvfleet.contracts.engine_labels): the
# watches see the operator's objects only, not every ConfigMap of the cluster.
CACHE_SELECTOR = f"{APP_NAME_LABEL}={ENGINE_APP}"
# Items of a LIST carry no apiVersion and kind (only watch events and single GETs do): a read puts
# them back, or every child listed at start would differ from its rendering and be applied again.
KINDS = {
    "deployments": "Deployment",
    "configmaps": "ConfigMap",
    "services": "Service",
    "poddisruptionbudgets": "PodDisruptionBudget",
    "servicemonitors": "ServiceMonitor",
    "pods": "Pod",
}
MAX_REMEMBERED_WRITES = 10_000  # applied objects waiting for their watch event; a bound, not a target


class ObjectReads(Protocol):
    """The two reads the reconciler makes of children and pods (``KubeClient`` has them too)."""

    async def get_object(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None: ...

    async def list_objects(self, ref: Ref, namespace: str | None, label_selector: str) -> list[dict[str, Any]]: ...


def version_number(obj: Mapping[str, Any]) -> int:
    """The object's resourceVersion as a number (etcd's revision; 0 when absent or not a number):
    only used to tell which of two copies of one object is newer."""
    try:
        return int(resource_version(obj))
    except ValueError:
        return 0


def json_copy(value: Any) -> Any:
    """A deep copy of parsed JSON (dicts, lists and scalars): a few times faster than
    ``copy.deepcopy``, which keeps a memo for shared and cyclic objects that JSON cannot hold; every
    converged resync copies each child it reads, so this was a large part of an idle operator's CPU."""
    if isinstance(value, dict):  # before the Mapping ABC: its isinstance is several times slower
        return {k: json_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_copy(v) for v in value]
    if isinstance(value, Mapping):
        return {k: json_copy(v) for k, v in value.items()}
    return value


def typed(ref: Ref, obj: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``obj`` with its apiVersion and kind (absent from a LIST's items)."""
    out: dict[str, Any] = json_copy(obj)
    out.setdefault("apiVersion", ref.api_version)
    if ref.plural in KINDS:
        out.setdefault("kind", KINDS[ref.plural])
    return out


def matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def parse_selector(selector: str) -> dict[str, str]:
    """An equality selector ``a=b,c=d`` (the only form the operator writes)."""
    pairs = [part.split("=", 1) for part in selector.split(",") if part]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"only equality selectors are cached, got {selector!r}")
    return {k: v for k, v in pairs}


class ChildCache:
    """Watches of ``kinds`` (cluster-wide, or one per namespace) that answer ``ObjectReads``."""

    def __init__(
        self,
        client: KubeClient,
        kinds: tuple[Ref, ...],
        *,
        namespaces: tuple[str, ...] = (),
        settings: WatchSettings | None = None,
        listeners: Mapping[Ref, OnChange] | None = None,
    ) -> None:
        """``listeners``: also told of every change of that kind (the rollout nudges, for Deployments)."""
        self._client = client
        self._namespaces = namespaces
        self._listeners = dict(listeners or {})
        self.watches: dict[Ref, dict[str | None, ResourceWatch]] = {
            ref: {
                ns: ResourceWatch(
                    client,
                    ref.collection(ns),
                    self._on_change(ref),
                    label_selector=CACHE_SELECTOR,
                    settings=settings,
                    transform=keep_pod_status if ref.plural == "pods" else without_managed_fields,
                )
                for ns in (namespaces or (None,))
            }
            for ref in kinds
        }
        # Objects we applied, by (plural, namespace, name), until the watch catches up with them.
        self._written: dict[tuple[str, str, str], dict[str, Any]] = {}
        # The names in each store by (plural, namespace), kept from the watches' changes: a list of one
        # deployment's pods reads its namespace's few, not every pod of the cluster (3,000 at 1,000
        # deployments, on every resync of each: most of an idle operator's CPU).
        self._names: dict[tuple[str, str], set[str]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def _on_change(self, ref: Ref) -> Callable[[ObjectKey, Mapping[str, Any] | None], None]:
        listener = self._listeners.get(ref)

        def changed(key: ObjectKey, obj: Mapping[str, Any] | None) -> None:
            """The watch caught up with a write of ours (this version or newer), or saw the object
            go (deleted after our write: by hand, or with its namespace): the store is the truth."""
            written = self._written.get((ref.plural, *key))
            if written is not None and (obj is None or version_number(obj) >= version_number(written)):
                del self._written[(ref.plural, *key)]
            names = self._names.setdefault((ref.plural, key[0]), set())
            if obj is None:
                names.discard(key[1])
                if not names:
                    del self._names[(ref.plural, key[0])]
            else:
                names.add(key[1])
            if listener is not None:
                listener(key, obj)

        return changed

    def start(self) -> None:
        for by_ns in self.watches.values():
            for watch in by_ns.values():
                self._tasks.append(asyncio.create_task(watch.run(), name=f"cache {watch.path}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    @property
    def synced(self) -> bool:
        return all(w.synced for by_ns in self.watches.values() for w in by_ns.values())

    def _watch(self, ref: Ref, namespace: str | None) -> ResourceWatch | None:
        by_ns = self.watches.get(ref)
        if by_ns is None or namespace is None:
            return None
        watch = by_ns.get(namespace if self._namespaces else None)
        return watch if watch is not None and watch.synced else None

    def remember(self, ref: Ref, obj: Mapping[str, Any]) -> None:
        """An object the operator just wrote: read it from here until the watch has it (or newer)."""
        if ref not in self.watches:
            return
        meta = obj.get("metadata") or {}
        self._written[(ref.plural, str(meta.get("namespace") or ""), str(meta.get("name") or ""))] = dict(
            without_managed_fields(obj)
        )
        while len(self._written) > MAX_REMEMBERED_WRITES:
            self._written.pop(next(iter(self._written)))

    def forget(self, ref: Ref, namespace: str, name: str) -> None:
        self._written.pop((ref.plural, namespace, name), None)

    async def get_object(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        watch = self._watch(ref, namespace)
        if watch is None:
            return await self._client.get_object(ref, namespace, name)
        assert namespace is not None
        seen = watch.store.get((namespace, name))
        written = self._written.get((ref.plural, namespace, name))
        if written is not None:
            if seen is not None and version_number(seen) >= version_number(written):
                del self._written[(ref.plural, namespace, name)]  # the watch caught up
            else:
                return typed(ref, written)
        return typed(ref, seen) if seen is not None else None

    async def list_objects(self, ref: Ref, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        watch = self._watch(ref, namespace)
        wanted = parse_selector(label_selector)
        if watch is None or not _covers(wanted):
            return await self._client.list_objects(ref, namespace, label_selector)
        assert namespace is not None
        found = (watch.store.get((namespace, name)) for name in sorted(self._names.get((ref.plural, namespace), ())))
        return [typed(ref, obj) for obj in found if obj is not None and matches(obj, wanted)]


def _cache_labels() -> dict[str, str]:
    return dict([CACHE_SELECTOR.split("=", 1)])


def _covers(wanted: Mapping[str, str]) -> bool:
    """A list is answered from the cache only when its selector implies the cache's own."""
    return all(wanted.get(k) == v for k, v in _cache_labels().items())
