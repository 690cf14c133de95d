"""A small in-memory Kubernetes API server for the list/watch semantics KMock does not have.

KMock keeps one resourceVersion forever, ignores ``resourceVersion`` and ``timeoutSeconds`` on a watch
and replays every object as ADDED on each one, so resume, bookmarks and 410 Gone cannot be told
apart there. This server (aiohttp, on a loopback port) does what the real API server does for them:

- every write advances a global resourceVersion; a LIST answers the current one;
- a WATCH from version V replays the changes after V, then streams new ones; it ends cleanly after
  ``timeoutSeconds`` or when the test calls ``end_watches()``;
- ``compact()`` forgets history: a watch from an older version gets an ERROR event with code 410
  in a 200 stream ("too old resource version"), as kube-apiserver sends it;
- ``bookmark()`` sends a BOOKMARK carrying the current version to watches that asked for them;
- ``fail_next(status, retry_after_s)`` answers the next requests with that status (429, 503), in a
  Status object with the reason kube-apiserver gives that status.

Every request is recorded (``requests``: verb, path, query) so tests count LISTs and WATCHes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# metav1.StatusReason per HTTP status, as kube-apiserver sends them.
STATUS_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


@dataclass
class Seen:
    verb: str  # list | watch
    path: str
    query: dict[str, str]
    at_s: float  # the event loop's clock when it arrived
    authorization: str | None = None


@dataclass
class WatchApi:
    version: int = 1
    objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = field(default_factory=dict)
    history: list[tuple[int, str, str, dict[str, Any]]] = field(default_factory=list)
    compacted: int = 0
    requests: list[Seen] = field(default_factory=list)
    failures: list[tuple[int, float | None]] = field(default_factory=list)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    end_at_once: bool = False  # every watch ends as soon as it starts, empty (a misbehaving proxy)
    _generation: int = 0  # bumped by end_watches(): streams opened before it end
    _bookmarks: int = 0
    _closing: bool = False
    _open: int = 0  # watch streams being served
    _runner: web.AppRunner | None = None
    url: str = ""

    # The resource a path names: "/apis/g/v/plural" or "/apis/g/v/namespaces/ns/plural" -> (g/v/plural, ns).
    @staticmethod
    def _parse(path: str) -> tuple[str, str | None]:
        parts = path.strip("/").split("/")
        prefix = parts[:3] if parts[0] == "apis" else parts[:2]
        rest = parts[len(prefix) :]
        if len(rest) == 3 and rest[0] == "namespaces":
            return "/".join([*prefix, rest[2]]), rest[1]
        return "/".join([*prefix, rest[0]]), None

    async def _record(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        async with self._changed:
            self.history.append((self.version, resource, kind, copy.deepcopy(obj)))
            self._changed.notify_all()

    async def put(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (``collection`` like "/apis/kvfleet.io/v1alpha1/inferencedeployments")."""
        resource, _ = self._parse(collection)
        meta = obj.setdefault("metadata", {})
        key = (meta.get("namespace", ""), meta["name"])
        store = self.objects.setdefault(resource, {})
        kind = "MODIFIED" if key in store else "ADDED"
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        store[key] = copy.deepcopy(obj)
        await self._record(resource, kind, obj)
        return obj

    async def delete(self, collection: str, namespace: str, name: str) -> None:
        resource, _ = self._parse(collection)
        obj = self.objects[resource].pop((namespace, name))
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        await self._record(resource, "DELETED", obj)

    def compact(self) -> None:
        """Forget the history so far, as etcd compaction does."""
        self.compacted = self.version
        self.history.clear()

    async def end_watches(self) -> None:
        """End every open watch cleanly, as the server does when their timeoutSeconds pass."""
        async with self._changed:
            self._generation += 1
            self._changed.notify_all()

    async def bookmark(self) -> None:
        async with self._changed:
            self._bookmarks += 1
            self._changed.notify_all()

    def fail_next(self, status: int, retry_after_s: float | None = None, times: int = 1) -> None:
        self.failures.extend([(status, retry_after_s)] * times)

    def seen(self, verb: str, path_part: str = "") -> list[Seen]:
        return [r for r in self.requests if r.verb == verb and path_part in r.path]

    @staticmethod
    def _selected(obj: dict[str, Any], namespace: str | None, selector: str | None) -> bool:
        meta = obj.get("metadata") or {}
        if namespace is not None and meta.get("namespace") != namespace:
            return False
        labels = meta.get("labels") or {}
        for term in (selector or "").split(","):
            if not term:
                continue
            key, _, value = term.partition("=")
            if key not in labels or (value and labels[key] != value):
                return False
        return True

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        watching = query.get("watch") in ("true", "1")
        seen = Seen("watch" if watching else "list", request.path, query, asyncio.get_running_loop().time())
        seen.authorization = request.headers.get("Authorization")
        self.requests.append(seen)
        if self.failures:
            status, retry_after = self.failures.pop(0)
            headers = {"Retry-After": str(int(retry_after))} if retry_after is not None else {}
            body = {"kind": "Status", "code": status, "message": f"scripted {status}"}
            if status in STATUS_REASONS:
                body["reason"] = STATUS_REASONS[status]
            return web.json_response(body, status=status, headers=headers)
        resource, namespace = self._parse(request.path)
        selector = query.get("labelSelector")
        if not watching:
            items = [o for o in self.objects.get(resource, {}).values() if self._selected(o, namespace, selector)]
            body = {"kind": "List", "metadata": {"resourceVersion": str(self.version)}, "items": items}
            return web.json_response(body)
        return await self._watch(request, resource, namespace, selector, query)

    async def _watch(
        self, request: web.Request, resource: str, namespace: str | None, selector: str | None, query: dict[str, str]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self._open += 1
        try:
            await self._stream(response, resource, namespace, selector, query)
            await response.write_eof()  # a clean end: the last chunk, as the API server ends a watch
        finally:
            self._open -= 1
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        resource: str,
        namespace: str | None,
        selector: str | None,
        query: dict[str, str],
    ) -> None:

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        if self.end_at_once:
            return
        since = int(query.get("resourceVersion") or 0)
        if query.get("resourceVersion") and since < self.compacted:
            gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}
            await send({"type": "ERROR", "object": gone})
            return
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        deadline = asyncio.get_running_loop().time() + timeout_s
        bookmarks = query.get("allowWatchBookmarks") == "true"
        generation, seen_bookmarks, sent = self._generation, self._bookmarks, since
        while True:
            for version, res, kind, obj in list(self.history):
                if version > sent and res == resource and self._selected(obj, namespace, selector):
                    await send({"type": kind, "object": obj})
                if version > sent:
                    sent = version
            if bookmarks and self._bookmarks != seen_bookmarks:
                seen_bookmarks = self._bookmarks
                kind_name = resource.rsplit("/", 1)[-1]
                await send(
                    {"type": "BOOKMARK", "object": {"kind": kind_name, "metadata": {"resourceVersion": str(sent)}}}
                )
            remaining = deadline - asyncio.get_running_loop().time()
            if self._closing or self._generation != generation or remaining <= 0:
                return
            async with self._changed:
                news = (self.history and self.history[-1][0] > sent) or self._bookmarks != seen_bookmarks
                if not news:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=remaining)

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._closing = False
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        """Go away as a restarting API server does: open watches end, then the port closes."""
        self._closing = True
        async with self._changed:
            self._changed.notify_all()
        for _ in range(100):  # bounded: 1 s for the streams to end cleanly
            if not self._open:
                break
            await asyncio.sleep(0.01)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
