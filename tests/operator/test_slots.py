"""The reconcile slots (operator/slots.py): a bound, priority before arrival, and cancellation that
neither loses a slot nor hands one to a task that is gone."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.operator.slots import Priority, Slots


async def test_at_most_size_hold_at_once() -> None:
    slots = Slots(2)
    peak = 0

    async def work() -> None:
        nonlocal peak
        async with slots.hold(Priority.CHANGE):
            peak = max(peak, slots.taken)
            await asyncio.sleep(0.01)

    await asyncio.gather(*(work() for _ in range(10)))
    assert peak == 2
    assert slots.taken == 0 and not slots.locked()


async def test_a_freed_slot_goes_to_the_first_waiter_of_the_best_priority() -> None:
    slots = Slots(1)
    order: list[str] = []

    async def work(name: str, priority: Priority) -> None:
        async with slots.hold(priority):
            order.append(name)

    async with slots.hold(Priority.CHANGE):
        assert slots.locked()
        tasks = []
        for name, priority in [("c1", Priority.CHANGE), ("s1", Priority.STATUS), ("c2", Priority.CHANGE)]:
            tasks.append(asyncio.create_task(work(name, priority)))
            await asyncio.sleep(0)  # arrive in this order
        tasks.append(asyncio.create_task(work("s2", Priority.STATUS)))
        await asyncio.sleep(0.01)
        assert order == []
    await asyncio.gather(*tasks)
    assert order == ["s1", "s2", "c1", "c2"]


async def test_a_newcomer_does_not_overtake_a_waiter() -> None:
    """A slot freed while someone waits is handed to the waiter, not to a task arriving just then."""
    slots = Slots(1)
    order: list[str] = []

    async def work(name: str) -> None:
        async with slots.hold(Priority.CHANGE):
            order.append(name)

    async with slots.hold(Priority.CHANGE):
        waiter = asyncio.create_task(work("waiter"))
        await asyncio.sleep(0)
    newcomer = asyncio.create_task(work("newcomer"))
    await asyncio.gather(waiter, newcomer)
    assert order == ["waiter", "newcomer"]


async def test_a_cancelled_waiter_loses_no_slot() -> None:
    slots = Slots(1)
    async with slots.hold(Priority.CHANGE):
        waiting = asyncio.create_task(slots.hold(Priority.STATUS).__aenter__())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    assert slots.taken == 0
    async with slots.hold(Priority.CHANGE):  # the slot is free again
        assert slots.taken == 1


async def test_a_waiter_cancelled_just_as_it_was_handed_the_slot_passes_it_on() -> None:
    slots = Slots(1)
    entered: list[str] = []

    async def work(name: str) -> None:
        async with slots.hold(Priority.CHANGE):
            entered.append(name)

    holder = slots.hold(Priority.CHANGE)
    await holder.__aenter__()
    first = asyncio.create_task(work("first"))
    second = asyncio.create_task(work("second"))
    await asyncio.sleep(0)
    await holder.__aexit__(None, None, None)  # hands the slot to "first" ...
    first.cancel()  # ... which is cancelled before it runs
    await asyncio.gather(first, second, return_exceptions=True)
    assert entered == ["second"]
    assert slots.taken == 0


def test_size_is_bounded() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Slots(0)
