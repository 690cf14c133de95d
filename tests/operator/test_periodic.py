"""The periodic looks (operator/periodic.py): when each deployment is due, and the loop's bounds."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from kvfleet.operator.periodic import LookSettings, PeriodicLooks, due_s, interval_s, phase, unsettled

SETTINGS = LookSettings(resync_interval_s=30.0, rollout_check_interval_s=5.0, retry_delay_s=10.0, tick_s=0.05)


def body(**conditions: tuple[str, str]) -> dict[str, Any]:
    listed = [{"type": t, "status": status, "reason": reason} for t, (status, reason) in conditions.items()]
    return {"status": {"conditions": listed}}


SETTLED = body(Ready=("True", "ReplicasReady"), Progressing=("False", "Complete"), Degraded=("False", "AsExpected"))


def test_what_is_unsettled() -> None:
    assert not unsettled(SETTLED)
    assert unsettled({})  # no status yet: a create whose first reconcile failed is retried soon
    assert unsettled(body(Ready=("False", "NoReplicaReady"), Progressing=("True", "RollingOut")))
    assert unsettled(body(Ready=("True", "ReplicasReady"), Degraded=("True", "CrashLoopBackOff")))
    assert not unsettled(body(Ready=("False", "InvalidSpec"), Degraded=("True", "InvalidSpec")))
    assert unsettled(body(Ready=("False", "ServedNameTaken"), Degraded=("True", "ServedNameTaken")))
    assert interval_s(SETTLED, SETTINGS) == 30.0 and interval_s({}, SETTINGS) == 5.0


def test_due_after_the_last_reconcile_or_at_a_phase_of_the_first_interval() -> None:
    key = ("team-a", "llama")
    assert due_s(100.0, 0.0, key, 30.0) == 130.0
    first = due_s(None, 50.0, key, 30.0)
    assert 50.0 <= first < 80.0 and first == 50.0 + phase(key) * 30.0
    # Names spread over the interval: 1,000 deployments seen at start are not all due at once.
    phases = sorted(phase(("ns", f"d{i}")) for i in range(1000))
    assert phases[0] < 0.01 and phases[-1] > 0.99
    assert max(b - a for a, b in itertools.pairwise(phases)) < 0.02


def test_settings_are_bounded() -> None:
    with pytest.raises(ValueError, match="resync_interval_s"):
        LookSettings(resync_interval_s=0, rollout_check_interval_s=5)
    with pytest.raises(ValueError, match="tick_s"):
        LookSettings(resync_interval_s=30, rollout_check_interval_s=5, tick_s=0)


class World:
    """Bodies, the reconciles they get and the slots free, with a clock the test moves."""

    def __init__(self, n: int, free: int = 16) -> None:
        self.now = 1000.0
        self.bodies = {("ns", f"d{i}"): SETTLED for i in range(n)}
        self.last: dict[tuple[str, str], float] = {}
        self.calls: list[tuple[str, str]] = []
        self.free = free
        self.fail: set[tuple[str, str]] = set()
        self.release = asyncio.Event()
        self.release.set()

    async def reconcile(self, namespace: str, name: str) -> None:
        self.calls.append((namespace, name))
        await self.release.wait()
        if (namespace, name) in self.fail:
            raise RuntimeError("API server unavailable")
        self.last[(namespace, name)] = self.now

    def looks(self) -> PeriodicLooks:
        looks = PeriodicLooks(
            SETTINGS,
            bodies=lambda: list(self.bodies.items()),
            reconcile=self.reconcile,
            last_reconciled=self.last.get,
            free_slots=lambda: self.free,
            clock=lambda: self.now,
        )
        looks.due(self.now)  # first sight of every body, now
        return looks


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_each_deployment_is_looked_at_once_per_interval() -> None:
    world = World(100, free=1000)
    looks = world.looks()
    for step in range(1, 31):  # one interval, a second at a time
        world.now = 1000.0 + step
        looks.tick()
        await settle()
    assert sorted(world.calls) == sorted(world.bodies)  # every one once, spread over the interval
    world.calls.clear()
    world.now += 29.0  # a reconcile by any trigger counts: nothing is due again before its interval
    looks.tick()
    await settle()
    assert len(world.calls) < 100
    world.now += 1.0
    looks.tick()
    await settle()
    assert sorted(world.calls) == sorted(world.bodies)


async def test_an_unsettled_deployment_is_looked_at_at_the_rollout_pace() -> None:
    world = World(2, free=1000)
    rolling = ("ns", "d0")
    world.bodies[rolling] = body(Ready=("False", "NoReplicaReady"), Progressing=("True", "RollingOut"))
    world.last = {key: world.now for key in world.bodies}
    looks = world.looks()
    world.now += 5.0
    looks.tick()
    await settle()
    assert world.calls == [rolling]


async def test_a_tick_starts_no_more_than_the_free_slots_and_none_twice() -> None:
    world = World(50, free=4)
    world.release.clear()  # reconciles hang: their looks stay running
    looks = world.looks()
    world.now += 60.0  # everything due
    assert looks.tick() == 4
    await settle()
    assert len(world.calls) == 4
    world.free = 0
    assert looks.tick() == 0
    world.free = 50
    assert looks.tick() == 46  # the 4 running are not started again
    await settle()
    assert len(set(world.calls)) == 50
    world.release.set()
    await settle()


async def test_a_failed_look_waits_the_retry_delay_and_a_deleted_deployment_is_forgotten() -> None:
    world = World(1, free=10)
    key = ("ns", "d0")
    world.fail.add(key)
    looks = world.looks()
    world.now += 60.0
    looks.tick()
    await settle()
    assert world.calls == [key]
    world.now += SETTINGS.retry_delay_s - 1
    looks.tick()
    await settle()
    assert world.calls == [key]  # not before the retry delay
    world.now += 1.0
    looks.tick()
    await settle()
    assert world.calls == [key, key]
    del world.bodies[key]
    assert looks.due(world.now + 1000) == []


async def test_the_loop_runs_and_stops_its_looks() -> None:
    world = World(3, free=10)
    world.release.clear()
    looks = world.looks()
    world.now += 60.0
    task = asyncio.create_task(looks.run())
    await asyncio.sleep(0.2)
    assert len(world.calls) == 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
