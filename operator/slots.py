"""At most N reconciles at once, the waiting ones served by priority, then in arrival order.

Why priorities: at 1,000 deployments a change to all of them queues 1,000 template changes (a fresh
read and two or three writes each) while the first engine Deployments already roll. The reconciles
that only bring status up to date with a finished rollout (a rollout nudge), apply a new replica
count (the autoscaler's, including a wake from zero) or report an invalid spec are cheap and are
what a user waits on; first come, first served, they waited behind every queued template change
(status trailed finished rollouts by 311 s p50 in docs/benchmarks/scale.md). They go first. They
cannot starve the rest: nudges run from a bounded set of workers (rollout_nudge.py), and each one
exists only because an earlier change was applied.

``asyncio.Semaphore`` is strictly first come, first served, hence this small class.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from enum import IntEnum


class Priority(IntEnum):
    """Lower goes first."""

    STATUS = 0
    """Status, replicas or a rejected spec: one or two small writes, and what a user waits on."""
    CHANGE = 1
    """A spec change, a create or a start-up pass: renders and applies children."""


class Slots:
    """A bound of ``size`` holders; waiters take a freed slot by (priority, arrival)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self._free = size
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def taken(self) -> int:
        return self.size - self._free

    def locked(self) -> bool:
        """No slot is free now (a caller that will not wait should come back later)."""
        return self._free == 0

    @asynccontextmanager
    async def hold(self, priority: Priority) -> AsyncIterator[None]:
        if self._free > 0 and not self._waiting:
            self._free -= 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (int(priority), next(self._arrivals), future))
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release()  # handed a slot just as it was cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        # The slot goes straight to the first live waiter, so a newcomer cannot take it in between.
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():  # a cancelled waiter's future is done: skipped
                future.set_result(None)
                return
        self._free += 1
