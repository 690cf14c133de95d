"""The rollout nudges (operator/rollout_nudge.py): which engine Deployment changes queue their owner,
how a burst of them coalesces into one reconcile, and the bounds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfleet.contracts import DEPLOYMENT_LABEL
from kvfleet.operator.rollout_nudge import NudgeSettings, RolloutNudges


def engine(owner: str, *, generation: int = 1, observed: int = 1, ready: int = 0, updated: int = 0) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{owner}-engine",
            "namespace": "ns",
            "generation": generation,
            "labels": {DEPLOYMENT_LABEL: owner},
            "annotations": {"note": "x"},
        },
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": observed,
            "replicas": 2,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "availableReplicas": ready,
        },
    }


KEY = ("ns", "m-engine")


async def drain(nudges: RolloutNudges, settings: NudgeSettings) -> list[tuple[str, str]]:
    """Run the workers until every queued owner has been reconciled; the owners, in order."""
    done: list[tuple[str, str]] = []

    async def reconcile(namespace: str, name: str) -> None:
        done.append((namespace, name))

    task = asyncio.create_task(nudges.run(reconcile))
    await asyncio.wait_for(nudges._queue.join(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return done


async def test_a_status_change_queues_the_owner_and_a_first_sighting_does_not() -> None:
    settings = NudgeSettings(coalesce_s=0)
    nudges = RolloutNudges(settings)
    nudges.seen(KEY, engine("m"))  # listed at start, or just created: the creator computed its status
    assert nudges.pending == 0
    nudges.seen(KEY, {**engine("m"), "metadata": {**engine("m")["metadata"], "annotations": {"note": "y"}}})
    assert nudges.pending == 0, "nothing status is computed from changed"
    nudges.seen(KEY, engine("m", ready=1, updated=1))
    assert nudges.pending == 1
    assert await drain(nudges, settings) == [("ns", "m")]


async def test_a_deleted_engine_deployment_queues_its_owner() -> None:
    settings = NudgeSettings(coalesce_s=0)
    nudges = RolloutNudges(settings)
    nudges.seen(KEY, engine("m"))
    nudges.seen(KEY, None)  # deleted by hand: the owner's reconcile restores it at once
    assert await drain(nudges, settings) == [("ns", "m")]
    nudges.seen(KEY, None)
    assert nudges.pending == 0, "an unknown Deployment's deletion has no owner to queue"


async def test_a_deployment_without_the_owner_label_is_ignored() -> None:
    nudges = RolloutNudges(NudgeSettings(coalesce_s=0))
    stray = engine("m")
    stray["metadata"]["labels"] = {}
    nudges.seen(KEY, stray)
    nudges.seen(KEY, {**stray, "status": {"readyReplicas": 2}})
    assert nudges.pending == 0


async def test_one_rollouts_burst_of_changes_is_one_reconcile() -> None:
    settings = NudgeSettings(coalesce_s=0.2)
    nudges = RolloutNudges(settings)
    nudges.seen(KEY, engine("m", generation=2))
    for ready in (0, 1, 2):  # the Deployment controller's writes, a few ms apart
        nudges.seen(KEY, engine("m", generation=2, observed=2, ready=ready, updated=ready))
    other = ("ns", "o-engine")
    nudges.seen(other, engine("o"))
    nudges.seen(other, engine("o", ready=2, updated=2))
    assert sorted(await drain(nudges, settings)) == [("ns", "m"), ("ns", "o")]
    assert nudges.stats.nudged == 2 and nudges.stats.reconciled == 2


async def test_a_change_during_the_reconcile_queues_the_owner_again() -> None:
    settings = NudgeSettings(coalesce_s=0)
    nudges = RolloutNudges(settings)
    nudges.seen(KEY, engine("m"))
    calls: list[int] = []

    async def reconcile(namespace: str, name: str) -> None:
        calls.append(len(calls))
        if len(calls) == 1:  # the rollout moved on while this reconcile ran
            nudges.seen(KEY, engine("m", ready=2, updated=2))

    nudges.seen(KEY, engine("m", ready=1, updated=1))
    task = asyncio.create_task(nudges.run(reconcile))
    await asyncio.wait_for(nudges._queue.join(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert calls == [0, 1]


async def test_the_queue_is_bounded_and_a_failing_reconcile_stops_no_worker() -> None:
    settings = NudgeSettings(coalesce_s=0, workers=1, max_pending=2)
    nudges = RolloutNudges(settings)
    for owner in ("a", "b", "c"):
        nudges.nudge(("ns", owner))
    assert nudges.pending == 2 and nudges.stats.dropped == 1
    done: list[str] = []

    async def reconcile(namespace: str, name: str) -> None:
        if name == "a":
            raise RuntimeError("API server unavailable")
        done.append(name)

    task = asyncio.create_task(nudges.run(reconcile))
    await asyncio.wait_for(nudges._queue.join(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert done == ["b"] and nudges.stats.failed == 1


@pytest.mark.parametrize(("field", "value"), [("coalesce_s", -1), ("workers", 0), ("max_pending", 0)])
def test_settings_are_bounded(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        NudgeSettings(**{field: value})  # type: ignore[arg-type]
