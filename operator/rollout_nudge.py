"""Reconcile an InferenceDeployment when its engine Deployment's rollout moves, not on a timer.

Why: status (Ready, Progressing, readyReplicas) follows the engine Deployment's status, which the
operator's watch (``child_cache.py``) sees change the moment the Deployment controller writes it.
Before, only the rollout check (a timer, every 5 s per unsettled deployment) read it, so Ready
came up to 5 s after the pods, and a change to 1,000 deployments at once waited on 1,000 timers.

``RolloutNudges.seen`` is the watch's callback for Deployments: when the parts of a Deployment that
status is computed from change (``DeploymentObservation``), or the Deployment is deleted, its
owner is queued. Workers take owners from the queue after a short coalescing delay, so the many
status writes of one rollout become about one reconcile per ``coalesce_s``, and run the same
reconcile the kopf handlers run (its per-deployment lock keeps the two from interleaving). A
Deployment seen for the first time queues nothing: at start-up the periodic looks reconcile
every deployment anyway, and a new Deployment's creator has just computed its status.

Everything is bounded: the queue holds at most ``max_pending`` owners (a nudge beyond it is
dropped and counted; the periodic looks still come), and ``workers`` reconciles run at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.contracts import DEPLOYMENT_LABEL

from .conditions import DeploymentObservation

log = logging.getLogger(__name__)

OwnerKey = tuple[str, str]  # (namespace, InferenceDeployment name)
ReconcileOwner = Callable[[str, str], Awaitable[object]]


@dataclass(frozen=True)
class NudgeSettings:
    coalesce_s: float = 0.5
    """A queued owner waits this long before its reconcile, so the Deployment controller's quick
    succession of status writes during one rollout step costs one reconcile, not one each."""
    workers: int = 8
    """Reconciles run at once from nudges (kopf's own handlers run besides)."""
    max_pending: int = 10_000
    """Owners waiting at most; a nudge beyond it is dropped (the rollout check still comes)."""

    def __post_init__(self) -> None:
        if not 0 <= self.coalesce_s <= 60:
            raise ValueError(f"coalesce_s must be in [0, 60], got {self.coalesce_s}")
        if not 1 <= self.workers <= 256:
            raise ValueError(f"workers must be in [1, 256], got {self.workers}")
        if not 1 <= self.max_pending <= 1_000_000:
            raise ValueError(f"max_pending must be in [1, 1000000], got {self.max_pending}")


def owner_of(obj: Mapping[str, Any]) -> str | None:
    """The InferenceDeployment an engine Deployment belongs to (its deployment label)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    owner = labels.get(DEPLOYMENT_LABEL)
    return str(owner) if owner else None


@dataclass
class NudgeStats:
    nudged: int = 0
    dropped: int = 0
    reconciled: int = 0
    failed: int = 0


class RolloutNudges:
    """Turns engine Deployment changes into reconciles of their owners (see the module doc)."""

    def __init__(self, settings: NudgeSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or NudgeSettings()
        self.clock = clock
        # What status is computed from, per Deployment seen, and its owner (for a deletion).
        self._seen: dict[tuple[str, str], tuple[DeploymentObservation, str]] = {}
        self._queue: asyncio.Queue[tuple[OwnerKey, float]] = asyncio.Queue(maxsize=self.settings.max_pending)
        self._queued: set[OwnerKey] = set()
        self.stats = NudgeStats()

    def seen(self, key: tuple[str, str], obj: Mapping[str, Any] | None) -> None:
        """The Deployment watch's callback (``kvfleet.kube.watch.OnChange``)."""
        before = self._seen.get(key)
        if obj is None:
            self._seen.pop(key, None)
            if before is not None:
                self.nudge((key[0], before[1]))  # a child deleted by hand: restore it now
            return
        owner = owner_of(obj)
        if owner is None:
            return
        observed = DeploymentObservation.from_object(dict(obj))
        self._seen[key] = (observed, owner)
        if before is not None and before[0] != observed:
            self.nudge((key[0], owner))

    def nudge(self, owner: OwnerKey) -> None:
        if owner in self._queued:
            return  # already waiting: its reconcile will read the latest state
        try:
            self._queue.put_nowait((owner, self.clock() + self.settings.coalesce_s))
        except asyncio.QueueFull:
            self.stats.dropped += 1
            return
        self._queued.add(owner)
        self.stats.nudged += 1

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def _work(self, reconcile: ReconcileOwner) -> None:
        while True:
            owner, due = await self._queue.get()
            try:
                wait_s = due - self.clock()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                # Off the waiting set before the reconcile: a change seen during it queues again.
                self._queued.discard(owner)
                try:
                    await reconcile(*owner)
                    self.stats.reconciled += 1
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the periodic looks are the fallback; a nudge never stops the workers
                    self.stats.failed += 1
                    log.info("reconcile of %s/%s on its Deployment's change failed: %s", *owner, e)
            finally:
                self._queue.task_done()

    async def run(self, reconcile: ReconcileOwner) -> None:
        """Run the workers until cancelled."""
        workers = [
            asyncio.create_task(self._work(reconcile), name=f"rollout-nudge-{i}") for i in range(self.settings.workers)
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
