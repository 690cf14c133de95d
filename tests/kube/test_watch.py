"""kvfleet.kube against a local API server with real list/watch semantics (tests/support/watch_api.py):
resume after a clean end without a LIST, bookmarks, 410 Gone -> LIST, 429 Retry-After, back-off."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from support.watch_api import WatchApi

from kvfleet.kube import KubeClient, KubeError, KubeNotFound
from kvfleet.kube.backoff import MAX_RETRY_AFTER_S, Backoff, parse_retry_after
from kvfleet.kube.watch import ObjectKey, ResourceWatch, WatchSettings

IDS = "/apis/kvfleet.io/v1alpha1/namespaces/team/inferencedeployments"
OTHER = "/api/v1/namespaces/team/configmaps"


def obj(name: str, value: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team"}, "spec": {"value": value}}


class Changes:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int | None]] = []

    def __call__(self, key: ObjectKey, found: Mapping[str, Any] | None) -> None:
        self.seen.append((key[1], None if found is None else found["spec"]["value"]))


@contextlib.asynccontextmanager
async def watching(api: WatchApi, changes: Changes, **settings: Any) -> AsyncIterator[ResourceWatch]:
    settings.setdefault("backoff", Backoff(0.01, 0.05))
    client = KubeClient.for_server(api.url, timeout_s=5)
    watch = ResourceWatch(client, IDS, changes, settings=WatchSettings(**settings))
    await watch.sync()
    task = asyncio.create_task(watch.run())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


async def until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_clean_end_resumes_from_the_last_version_without_a_list(api: WatchApi) -> None:
    await api.put(IDS, obj("a", 1))
    changes = Changes()
    async with watching(api, changes) as watch:
        await until(lambda: len(api.seen("watch")) == 1)
        changed = await api.put(IDS, obj("a", 2))
        await until(lambda: changes.seen[-1] == ("a", 2))
        await api.end_watches()  # the server's timeoutSeconds passed
        await until(lambda: len(api.seen("watch")) == 2)
        await api.put(IDS, obj("b", 3))
        await until(lambda: changes.seen[-1] == ("b", 3))
        assert len(api.seen("list")) == 1
        assert api.seen("watch")[1].query["resourceVersion"] == changed["metadata"]["resourceVersion"]
        assert watch.stats.clean_ends == 1 and watch.stats.gone == 0
        assert changes.seen == [("a", 1), ("a", 2), ("b", 3)]
        timeouts = [int(w.query["timeoutSeconds"]) for w in api.seen("watch")]
        assert all(300 <= t <= 600 for t in timeouts)  # drawn from [min, 2 x min]: reconnects spread out


async def test_a_bookmark_keeps_a_quiet_watch_resumable_after_compaction(api: WatchApi) -> None:
    """Writes elsewhere move the version on; without a bookmark the quiet watch's version would be
    compacted away and its resume a 410 and a LIST."""
    await api.put(IDS, obj("a", 1))
    changes = Changes()
    async with watching(api, changes) as watch:
        await until(lambda: len(api.seen("watch")) == 1)
        assert api.seen("watch")[0].query["allowWatchBookmarks"] == "true"
        for i in range(3):
            await api.put(OTHER, {"metadata": {"name": f"cm{i}", "namespace": "team"}, "spec": {"value": i}})
        await api.bookmark()
        await until(lambda: watch.stats.bookmarks == 1)
        assert watch.version == str(api.version)
        api.compact()
        await api.end_watches()
        await until(lambda: len(api.seen("watch")) == 2)
        await api.put(IDS, obj("a", 2))
        await until(lambda: changes.seen[-1] == ("a", 2))
        assert api.seen("watch")[1].query["resourceVersion"] == str(api.version - 1)
        assert len(api.seen("list")) == 1 and watch.stats.gone == 0


async def test_a_list_again_reports_only_what_changed(api: WatchApi) -> None:
    """After a LIST that replaces the store (410 Gone), the consumer hears of the changed objects
    only (compared by resourceVersion), not of every object again."""
    for name in ("a", "b", "c"):
        await api.put(IDS, obj(name, 1))
    changes = Changes()
    async with KubeClient.for_server(api.url) as client:
        watch = ResourceWatch(client, IDS, changes)
        await watch.list()
        assert sorted(changes.seen) == [("a", 1), ("b", 1), ("c", 1)]
        changes.seen.clear()
        await api.put(IDS, obj("b", 2))
        await api.delete(IDS, "team", "c")
        await api.put(IDS, obj("d", 1))
        await watch.list()
        assert sorted(changes.seen, key=str) == [("b", 2), ("c", None), ("d", 1)]
        assert set(watch.store) == {("team", "a"), ("team", "b"), ("team", "d")}
        assert watch.version == str(api.version)


async def test_410_from_compaction_lists_once(api: WatchApi) -> None:
    await api.put(IDS, obj("a", 1))
    changes = Changes()
    async with watching(api, changes) as watch:
        await until(lambda: len(api.seen("watch")) == 1)
        api.fail_next(429, retry_after_s=None)  # the resume is refused once (resumes, no LIST) ...
        await api.end_watches()
        await until(lambda: len(api.seen("watch")) == 3)
        assert len(api.seen("list")) == 1
        await api.put(OTHER, {"metadata": {"name": "x", "namespace": "team"}, "spec": {"value": 0}})
        await api.delete(IDS, "team", "a")
        await until(lambda: changes.seen[-1] == ("a", None))
        await api.put(OTHER, {"metadata": {"name": "y", "namespace": "team"}, "spec": {"value": 0}})
        api.compact()  # ... then its version is compacted away: 410 in the stream, one LIST
        await api.end_watches()
        await until(lambda: watch.stats.gone == 1 and len(api.seen("list")) == 2 and watch.synced)
        await api.put(IDS, obj("b", 1))
        await until(lambda: changes.seen[-1] == ("b", 1))
        assert len(api.seen("list")) == 2


async def test_429_retry_after_is_honoured_on_list_and_watch(api: WatchApi) -> None:
    api.fail_next(429, retry_after_s=1)
    changes = Changes()
    async with watching(api, changes):
        lists = api.seen("list")
        assert len(lists) == 2 and lists[1].at_s - lists[0].at_s >= 1.0  # back-off base is 0.01 s
        await until(lambda: len(api.seen("watch")) == 1)
        api.fail_next(429, retry_after_s=1)
        await api.end_watches()
        await until(lambda: len(api.seen("watch")) == 3)
        watches = api.seen("watch")
        assert watches[2].at_s - watches[1].at_s >= 1.0
        assert len(api.seen("list")) == 2  # a 429 resumes: no LIST


async def test_watches_that_end_at_once_are_backed_off_not_spun_on(api: WatchApi) -> None:
    api.end_at_once = True
    changes = Changes()
    async with watching(api, changes, backoff=Backoff(0.1, 0.2)) as watch:
        await asyncio.sleep(1.0)
        # Resumed at once, an empty 200 every ~ms would be hundreds of requests in this second.
        assert 3 <= len(api.seen("watch")) <= 12
        assert len(api.seen("list")) == 1 and watch.stats.clean_ends >= len(api.seen("watch")) - 1


async def test_client_maps_statuses_and_retry_after(api: WatchApi) -> None:
    async with KubeClient.for_server(api.url) as client:
        api.fail_next(429, retry_after_s=7)
        with pytest.raises(KubeError, match="HTTP 429 scripted 429") as caught:
            await client.get(IDS)
        assert (caught.value.status, caught.value.retry_after_s, caught.value.retryable) == (429, 7.0, True)
        api.fail_next(404)
        with pytest.raises(KubeNotFound):
            await client.get(IDS + "/x")
        api.fail_next(403)
        with pytest.raises(KubeError) as forbidden:
            await client.get(IDS)
        assert forbidden.value.retryable is False


def test_backoff_is_jittered_capped_and_floored_by_retry_after() -> None:
    backoff = Backoff(base_s=0.5, max_s=30)
    assert [backoff.wait_s(a, rand=lambda: 0.0) for a in range(4)] == [0.25, 0.5, 1.0, 2.0]
    assert [backoff.wait_s(a, rand=lambda: 1.0) for a in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff.wait_s(20, rand=lambda: 1.0) == 30.0
    assert backoff.wait_s(0, retry_after_s=5, rand=lambda: 0.0) == 5.0
    assert backoff.wait_s(0, retry_after_s=5, rand=lambda: 1.0) == 6.0
    assert backoff.wait_s(0, retry_after_s=86_400, rand=lambda: 0.0) == MAX_RETRY_AFTER_S
    assert parse_retry_after("3") == 3.0 and parse_retry_after("soon") is None and parse_retry_after(None) is None
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=0)
