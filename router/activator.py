"""The activator's queue: a bounded FIFO of requests held while a model has no ready replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from kvfleet.router.errors import QueueFullError, QueueTimeoutError


class HoldBudget:
    """How many requests the whole router may hold across its models.

    Each tenant's ``routing.maxQueue`` bounds its own queue (up to 100,000); their sum is not the
    tenants' to choose: a held request keeps its body (up to ``max_body_bytes``) in the router's
    memory, so one budget bounds them all. ``refused`` counts the requests it turned away.
    """

    def __init__(self, max_held: int) -> None:
        self.max_held = max_held
        self.held = 0
        self.refused = 0


class HoldQueue:
    """Requests of one model waiting for a replica, released first-in first-out.

    ``wait`` returns when ``release_all`` is called (the replica set changed: the caller looks again),
    raises ``QueueFullError`` when ``max_waiting`` are already waiting, and ``QueueTimeoutError`` when
    ``timeout_s`` passes first. A cancelled waiter (client gone) leaves the queue at once.
    """

    def __init__(self, model: str, *, max_waiting: int, retry_after_s: int, budget: HoldBudget | None = None) -> None:
        self.model = model
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.budget = budget or HoldBudget(max_waiting)
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, timeout_s: float) -> None:
        if len(self._waiters) >= self.max_waiting:
            raise QueueFullError(
                f"model {self.model!r} has no ready replica and {len(self._waiters)} requests are already "
                f"waiting (routing.maxQueue {self.max_waiting})",
                retry_after_s=self.retry_after_s,
            )
        budget = self.budget
        if budget.held >= budget.max_held:
            budget.refused += 1
            raise QueueFullError(
                f"model {self.model!r} has no ready replica and the router already holds {budget.held} requests "
                f"across all models (its limit, max_held_requests, is {budget.max_held})",
                retry_after_s=self.retry_after_s,
            )
        if timeout_s <= 0:
            raise self._timeout_error()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        budget.held += 1
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise self._timeout_error() from None
        finally:
            budget.held -= 1
            if not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):  # already released
                self._waiters.remove(future)

    def release_all(self) -> int:
        """Wake every waiter, oldest first (they resume in this order); returns how many."""
        released = 0
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)
                released += 1
        return released

    def _timeout_error(self) -> QueueTimeoutError:
        return QueueTimeoutError(
            f"no replica of model {self.model!r} became ready within routing.maxQueueWaitSeconds",
            retry_after_s=self.retry_after_s,
        )
