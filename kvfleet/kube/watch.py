"""``ResourceWatch``: a store of one resource kept current by list-then-watch, as client-go's reflector.

- One LIST (paged) fills the store; a WATCH then resumes from the list's resourceVersion.
- A watch the server ends cleanly (its ``timeoutSeconds``) resumes at once from the last version
  seen: no relist. ``allowWatchBookmarks`` makes the server send BOOKMARK events that advance that
  version through quiet stretches, so a resume after an hour without changes is not 410 Gone.
- 410 Gone (an HTTP 410, or an ERROR event with code 410) lists again.
- A watch that ends within a second with nothing in it is backed off from, never spun on.
- A refused connection or a 429 waits a jittered exponential back-off (at least the server's
  Retry-After), then resumes from the last version; a stream that broke mid-way, a 5xx or an ERROR
  event lists again after the back-off (changes may have been missed), as client-go does.
- ``timeoutSeconds`` is drawn from [min, 2 x min] per watch, so a fleet's watches do not all end
  and reconnect in the same second.
- The consumer's ``on_change(key, obj)`` is called once per object that changed (``obj`` None when
  it is gone), also after a relist (the relist is diffed against the store by resourceVersion).
- What is stored is ``transform(obj)``: by default the object without ``metadata.managedFields``
  (client-go's informers strip them the same way); no consumer reads them, and at 3,000 pods they
  were a large part of a store's memory. A consumer that needs less may drop more (``keep_pod_status``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from kvfleet.kube.backoff import Backoff
from kvfleet.kube.client import KubeClient
from kvfleet.kube.errors import KubeError, KubeGone, KubeUnreachable
from kvfleet.kube.retry import retry_while_healing

log = logging.getLogger(__name__)

ObjectKey = tuple[str, str]  # (namespace, name)
SHORT_WATCH_S = 1.0
"""A watch that ends cleanly sooner than this with no event is backed off from, not resumed at once."""
OnChange = Callable[[ObjectKey, "Mapping[str, Any] | None"], None]
Transform = Callable[["Mapping[str, Any]"], "Mapping[str, Any]"]


@dataclass(frozen=True)
class WatchSettings:
    min_watch_timeout_s: int = 300
    """Server-side ``timeoutSeconds`` of one watch is drawn from [this, 2 x this] (client-go's 5-10 min)."""
    page_size: int = 500
    """Objects per LIST page (``limit``; the rest follows by ``continue``)."""
    max_objects: int = 100_000
    """A bound on the store: a LIST larger than this fails loudly instead of exhausting memory."""
    backoff: Backoff = field(default_factory=Backoff)
    start_attempts: int = 8
    """Tries of the first LIST before ``sync`` gives up (the component then fails to start)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_watch_timeout_s <= 3600:
            raise ValueError("min_watch_timeout_s must be in [1, 3600]")
        if not 1 <= self.page_size <= 10_000:
            raise ValueError("page_size must be in [1, 10000]")
        if not 1 <= self.start_attempts <= 100:
            raise ValueError("start_attempts must be in [1, 100]")


@dataclass
class WatchStats:
    """What the watch has sent, for tests, metrics and logs."""

    lists: int = 0
    watches: int = 0
    clean_ends: int = 0
    bookmarks: int = 0
    gone: int = 0
    failures: int = 0
    events: int = 0


def object_key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def resource_version(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    return str(meta.get("resourceVersion") or "") if isinstance(meta, Mapping) else ""


def without_managed_fields(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object without ``metadata.managedFields`` (server-side apply's bookkeeping: the server
    keeps it; a reader of the object never needs it). Shares every other part with ``obj``."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping) or "managedFields" not in meta:
        return obj
    return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}


def keep_pod_status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """A pod as a reader of its state needs it: identity, labels, annotations, owners and status;
    no spec (its containers, env and volumes are most of a pod) and no managedFields."""
    return {k: v for k, v in without_managed_fields(obj).items() if k != "spec"}


class ResourceWatch:
    """Keeps ``store`` equal to the API server's objects at ``path`` (a collection URL)."""

    def __init__(
        self,
        client: KubeClient,
        path: str,
        on_change: OnChange,
        *,
        label_selector: str | None = None,
        settings: WatchSettings | None = None,
        rand: Callable[[], float] = random.random,
        transform: Transform = without_managed_fields,
    ) -> None:
        """``transform``: what of each object is stored and handed to ``on_change`` (a pure function;
        it must keep ``metadata``'s name, namespace and resourceVersion)."""
        self.client = client
        self.transform = transform
        self.path = path
        self.on_change = on_change
        self.label_selector = label_selector
        self.settings = settings or WatchSettings()
        self.rand = rand
        self.store: dict[ObjectKey, Mapping[str, Any]] = {}
        self.version = ""
        self.synced = False
        """The store is current and the watch may resume (False until a LIST succeeds, and after 410)."""
        self.listed = False
        """A LIST has succeeded at least once (the store holds real state, if maybe a stale one)."""
        self.stats = WatchStats()

    def _params(self) -> dict[str, str]:
        return {"labelSelector": self.label_selector} if self.label_selector else {}

    async def list(self) -> None:
        """LIST every page, then hand the differences to ``on_change`` and keep the version."""
        found: dict[ObjectKey, Mapping[str, Any]] = {}
        params = {**self._params(), "limit": str(self.settings.page_size)}
        version = ""
        while True:
            self.stats.lists += 1
            body = await self.client.get(self.path, params)
            for item in body.get("items") or []:
                if isinstance(item, Mapping):
                    found[object_key(item)] = self.transform(item)
            if len(found) > self.settings.max_objects:
                raise KubeError(f"list {self.path}: over {self.settings.max_objects} objects")
            meta = body.get("metadata") or {}
            version = str(meta.get("resourceVersion") or "")
            if not meta.get("continue"):
                break
            params["continue"] = str(meta["continue"])
        self._replace(found)
        self.version = version
        self.synced = self.listed = True

    def _replace(self, found: dict[ObjectKey, Mapping[str, Any]]) -> None:
        old, self.store = self.store, found
        for key in [k for k in old if k not in found]:
            self._notify(key, None)
        for key, obj in found.items():
            before = old.get(key)
            if before is None or resource_version(before) != resource_version(obj) or not resource_version(obj):
                self._notify(key, obj)

    def _notify(self, key: ObjectKey, obj: Mapping[str, Any] | None) -> None:
        # A consumer's bug must not stop the watch (and with it every later update).
        try:
            self.on_change(key, obj)
        except Exception:
            log.exception("watch %s: handling %s/%s failed", self.path, *key)

    async def sync(self) -> None:
        """The first LIST, retried with back-off while the failure can heal; raises the last error."""
        await retry_while_healing(
            self.list,
            attempts=self.settings.start_attempts,
            backoff=self.settings.backoff,
            what=f"list {self.path}",
            log=log,
            rand=self.rand,
        )

    async def run(self) -> None:
        """Watch forever (until cancelled). As client-go's reflector: a clean end resumes at once; a
        refused connection or a 429 resumes from the last version after a back-off; 410 Gone, and a
        stream that broke or failed otherwise (state may have moved on unseen), list again."""
        failures = 0
        while True:
            try:
                if not self.synced:
                    await self.list()
                started = asyncio.get_running_loop().time()
                events = self.stats.events + self.stats.bookmarks
                await self.watch_once()
                quick = asyncio.get_running_loop().time() - started < SHORT_WATCH_S
                if not (quick and events == self.stats.events + self.stats.bookmarks):
                    failures = 0
                    continue
                # Ended at once with nothing in it (a proxy closing streams, an overloaded server):
                # resuming at once would spin; back off, as client-go does for a "very short watch".
                wait_s = self.settings.backoff.wait_s(failures, None, self.rand)
                failures += 1
            except KubeGone as e:
                self.stats.gone += 1
                self.synced = False
                wait_s = self.settings.backoff.wait_s(0, e.retry_after_s, self.rand)
                log.info("%s; listing again in %.1fs", e, wait_s)
            except KubeError as e:
                self.stats.failures += 1
                resume = isinstance(e, KubeUnreachable) or e.status == 429
                if not resume:
                    self.synced = False
                wait_s = self.settings.backoff.wait_s(failures, e.retry_after_s, self.rand)
                failures += 1
                log.warning("%s; %s in %.1fs", e, "resuming" if resume and self.synced else "listing again", wait_s)
            await asyncio.sleep(wait_s)

    async def watch_once(self) -> None:
        """One watch request from ``version``; returns when the server ends it cleanly."""
        timeout_s = int(self.settings.min_watch_timeout_s * (1 + self.rand()))
        params = {
            **self._params(),
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        if self.version:
            params["resourceVersion"] = self.version
        self.stats.watches += 1
        # The read timeout outlasts the server's own end of the stream (bookmarks arrive about
        # once a minute, so a silent minute past the timeout means the connection is dead).
        async for event in self.client.stream_events(self.path, params, read_timeout_s=timeout_s + 30):
            self._apply(event)
        self.stats.clean_ends += 1

    def _apply(self, event: Any) -> None:
        if not isinstance(event, Mapping):
            raise KubeError(f"watch {self.path}: an event that is not an object")
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, Mapping):
            raise KubeError(f"watch {self.path}: a {kind} event without an object")
        if kind == "ERROR":
            code = obj.get("code")
            message = f"watch {self.path}: {obj.get('message') or obj}"
            if code == 410:
                raise KubeGone(message, 410)
            raise KubeError(message, code if isinstance(code, int) else None)
        version = resource_version(obj)
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            if version:
                self.version = version
            return
        self.stats.events += 1
        key = object_key(obj)
        if kind == "DELETED":
            if self.store.pop(key, None) is not None:
                self._notify(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            kept = self.transform(obj)
            self.store[key] = kept
            self._notify(key, kept)
        if version:
            self.version = version


class WatchCollector:
    """Each watch's ``WatchStats`` as one Prometheus counter family, read when scraped (nothing on the
    watch's own path): ``<name>_total{resource, event}``, event one of lists, watches, clean_ends,
    bookmarks, gone, failures, events. Relists (``gone``) and ``failures`` are what to alert on."""

    def __init__(self, name: str, watches: Sequence[ResourceWatch]) -> None:
        self.name = name
        self.watches = list(watches)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            self.name, "Kubernetes LIST/WATCH requests and watch outcomes", labels=["resource", "event"]
        )
        for watch in self.watches:
            resource = watch.path.rsplit("/", 1)[-1]
            for stat in fields(WatchStats):
                family.add_metric([resource, stat.name], float(getattr(watch.stats, stat.name)))
        yield family
