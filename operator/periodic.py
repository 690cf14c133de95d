"""Every InferenceDeployment looked at again on the operator's own clock, not by kopf's timers.

Two paces: the resync (``resync_interval_s``: restores drifted children, refreshes status) and,
while a deployment is not settled (not Ready, progressing, degraded, or never reconciled), the
rollout check (``rollout_check_interval_s``: pod failures reach status within seconds).

Why not kopf's timers: kopf puts a finalizer on every object a timer runs for (to stop the timer
before the object goes), so each create cost a finalizer patch and a watch round trip before the
first reconcile, and each delete one more write; at 1,000 deployments applied at once those were
2,000 writes and 10,000 watch events (every InferenceDeployment watcher sees each) on an API server
that was the bottleneck. This loop reads kopf's body index and needs no finalizer.

A reconcile by any trigger (a spec change, a rollout nudge, a new replica count) counts as a look:
the rollout check no longer repeats what a nudge did a moment before (it took half the operator's
CPU during a change to 1,000 at once). Deployments never reconciled since the operator started are
spread over their interval by a hash of their name, so a restart does not look at all at once.

Bounded: each tick starts at most as many reconciles as the reconciler has free slots, and none for
a deployment whose look is still running; a reconcile that finds its deployment busy is skipped and
stays due.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import claims

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class LookSettings:
    resync_interval_s: float
    rollout_check_interval_s: float
    retry_delay_s: float = 10.0
    """A look that failed (the API server did not answer) is not tried again before this."""
    tick_s: float = 0.5
    """How often due deployments are sought (one pass over the body index, no request)."""

    def __post_init__(self) -> None:
        for name in ("resync_interval_s", "rollout_check_interval_s", "retry_delay_s"):
            value = getattr(self, name)
            if not 0.2 <= value <= 3600:
                raise ValueError(f"{name} must be in [0.2, 3600] s, got {value}")
        if not 0.05 <= self.tick_s <= 60:
            raise ValueError(f"tick_s must be in [0.05, 60] s, got {self.tick_s}")


def unsettled(body: dict[str, Any]) -> bool:
    """Status says pods are still coming or failing, or there is no status yet (a create whose first
    reconcile failed): worth a look sooner than the calm resync."""
    conditions = {c.get("type"): c for c in ((body.get("status") or {}).get("conditions") or [])}
    if not conditions:
        return True
    ready, progressing, degraded = (conditions.get(t) or {} for t in ("Ready", "Progressing", "Degraded"))
    if degraded.get("reason") in ("InvalidSpec", "PolicyViolation"):
        return False  # nothing to watch until the spec changes
    if degraded.get("reason") == claims.REASON:
        return True  # the older claimant may go or rename at any time: look again soon
    return ready.get("status") != "True" or progressing.get("status") == "True" or degraded.get("status") == "True"


def interval_s(body: dict[str, Any], settings: LookSettings) -> float:
    return settings.rollout_check_interval_s if unsettled(body) else settings.resync_interval_s


def phase(key: Key) -> float:
    """A stable fraction in [0, 1) per deployment: where in its interval its first look falls."""
    return zlib.crc32(f"{key[0]}/{key[1]}".encode()) / 2**32


def due_s(last_s: float | None, first_seen_s: float, key: Key, every_s: float) -> float:
    """Pure: when a deployment is next looked at. ``every_s`` after its last reconcile; one not
    reconciled since the operator started, at its phase of the interval after it was first seen."""
    if last_s is not None:
        return last_s + every_s
    return first_seen_s + phase(key) * every_s


class PeriodicLooks:
    """The loop: every ``tick_s``, reconcile the deployments that are due (thin I/O over ``due_s``)."""

    def __init__(
        self,
        settings: LookSettings,
        bodies: Callable[[], Iterable[tuple[Key, dict[str, Any]]]],
        reconcile: Callable[[str, str], Awaitable[Any]],
        last_reconciled: Callable[[Key], float | None],
        free_slots: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._bodies = bodies
        self._reconcile = reconcile
        self._last = last_reconciled
        self._free = free_slots
        self._clock = clock
        self._first_seen: dict[Key, float] = {}
        self._retry_at: dict[Key, float] = {}
        self._running: dict[Key, asyncio.Task[None]] = {}

    def due(self, now: float) -> list[Key]:
        """The deployments due now, most overdue first; forgets deployments no longer listed."""
        found: list[tuple[float, Key]] = []
        seen: set[Key] = set()
        for key, body in self._bodies():
            seen.add(key)
            first = self._first_seen.setdefault(key, now)
            when = max(
                due_s(self._last(key), first, key, interval_s(body, self.settings)), self._retry_at.get(key, 0.0)
            )
            if when <= now and key not in self._running:
                found.append((when, key))
        for gone in self._first_seen.keys() - seen:
            del self._first_seen[gone]
            self._retry_at.pop(gone, None)
        return [key for _, key in sorted(found)]

    def tick(self) -> int:
        """Start the due looks that fit in the free slots; returns how many started."""
        room = self._free()
        if room <= 0:
            return 0
        started = 0
        for key in self.due(self._clock())[:room]:
            self._running[key] = asyncio.create_task(self._look(key), name=f"look {key[0]}/{key[1]}")
            started += 1
        return started

    async def _look(self, key: Key) -> None:
        try:
            await self._reconcile(*key)
            self._retry_at.pop(key, None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # looked at again after the delay; one failure never stops the loop
            self._retry_at[key] = self._clock() + self.settings.retry_delay_s
            log.warning("look at %s/%s failed, again in %.0f s: %s", key[0], key[1], self.settings.retry_delay_s, e)
        finally:
            self._running.pop(key, None)

    async def run(self) -> None:
        try:
            while True:
                self.tick()
                await asyncio.sleep(self.settings.tick_s)
        finally:
            tasks = list(self._running.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
