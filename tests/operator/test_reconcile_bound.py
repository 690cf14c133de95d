"""The reconcile bound (settings.max_concurrent_reconciles) and the timers that do not queue on it.

A timer's reconcile (``wait=False``) returns at once when its deployment is being reconciled or
every slot is taken: a timer left waiting is still running when the status it waits to write turns
its ``when`` filter false, and kopf then patches the object every ``cancellation_polling`` second
until it exits (seen at 1,000 deployments: ~45 patches a second). The reconciles here never reach
the API: the client is not called on these paths, and a call would fail the test.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from kvfleet.kube import KubeClient
from kvfleet.operator.reconcile import Reconciler
from kvfleet.operator.slots import Priority
from kvfleet_testkit.kube_emulator import operator_settings


class NoApi:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the API was called ({name})")


def reconciler(bound: int) -> Reconciler:
    async def post(*_: Any, **__: Any) -> None:
        raise AssertionError("an Event was posted")

    settings = operator_settings(max_concurrent_reconciles=bound)
    return Reconciler(cast(KubeClient, NoApi()), settings, post_event=post)


async def test_a_timer_skips_a_deployment_being_reconciled_and_a_full_operator() -> None:
    r = reconciler(bound=1)
    async with r._lock(("ns", "a")):  # a handler is reconciling "a"
        assert (await asyncio.wait_for(r.reconcile("ns", "a", wait=False), 1)).skipped
        # Another deployment, a free slot: not skipped (it then reaches the API, which fails here).
        try:
            await asyncio.wait_for(r.reconcile("ns", "b", wait=False), 1)
        except AssertionError as e:
            assert "the API was called" in str(e)
        else:
            raise AssertionError("b was skipped with a slot free")
    async with r._running.hold(Priority.CHANGE):  # the only slot is taken
        assert (await asyncio.wait_for(r.reconcile("ns", "b", wait=False), 1)).skipped


async def test_a_handler_waits_its_turn() -> None:
    r = reconciler(bound=1)
    async with r._running.hold(Priority.CHANGE):  # the only slot is taken
        waiting = asyncio.create_task(r.reconcile("ns", "a"))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # queued, not skipped
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    assert r._running.taken == 0


class Reads:
    """Records which deployment each reconcile read first (the order the slots were granted);
    every object is gone, so a reconcile ends after its first read."""

    def __init__(self) -> None:
        self.order: list[str] = []

    async def get_object(self, ref: Any, namespace: str, name: str) -> None:
        owner = name.removesuffix("-engine")
        if owner not in self.order:
            self.order.append(owner)


async def test_status_work_goes_ahead_of_queued_changes() -> None:
    """A nudge or a rescale (STATUS) queued after template changes runs before them; an invalid
    spec is STATUS whatever its handler asked; within a priority, arrival order."""
    reads = Reads()
    settings = operator_settings(max_concurrent_reconciles=1)

    def post(*_: Any, **__: Any) -> None:
        raise AssertionError("an Event was posted")

    r = Reconciler(cast(KubeClient, reads), settings, post_event=post)
    invalid = {"metadata": {"namespace": "ns", "name": "bad", "generation": 1}, "spec": {"model": {}}}
    async with r._running.hold(Priority.CHANGE):
        tasks = [
            asyncio.create_task(r.reconcile("ns", "change-1")),
            asyncio.create_task(r.reconcile("ns", "nudge-1", priority=Priority.STATUS)),
            asyncio.create_task(r.reconcile("ns", "change-2")),
            asyncio.create_task(r.reconcile("ns", "bad", body=invalid)),
            asyncio.create_task(r.reconcile("ns", "nudge-2", priority=Priority.STATUS)),
        ]
        await asyncio.sleep(0.1)
        assert reads.order == []  # all queued behind the held slot
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert reads.order == ["nudge-1", "bad", "nudge-2", "change-1", "change-2"]
    assert all(o.gone for o in outcomes)
