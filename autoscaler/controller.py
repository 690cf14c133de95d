"""The control loop: list deployments, observe, decide, export, apply. Thin: the policy decides.

Each tick decides for every autoscaled deployment; a wake-up (router signal) decides at once for
the woken deployments, without waiting for the tick. Only the Lease holder acts: a standby keeps
no state, so when it takes over it starts from the counts in status (and, with no history, it
scales nothing down for one scaleDownDelaySeconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from kvfleet.autoscaler.actuators import Actuator, ActuatorError, ScaleCommand, TargetGone
from kvfleet.autoscaler.deployments import DeploymentSource, DeploymentsUnavailable, Scaled
from kvfleet.autoscaler.metrics import AutoscalerMetrics
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy import DEFAULT_POLICY, Decision, PolicySettings, PolicyState, decide, initial_state
from kvfleet.autoscaler.settings import ControllerSettings
from kvfleet.autoscaler.sources import MetricSource, Target
from kvfleet.autoscaler.wake import WakeInbox

log = logging.getLogger(__name__)


class Leadership(Protocol):
    @property
    def is_leader(self) -> bool: ...


@dataclass(frozen=True)
class _Written:
    desired: int
    reason: str
    at_s: float
    last_scale_time: datetime


class Controller:
    def __init__(
        self,
        deployments: DeploymentSource,
        source: MetricSource,
        actuator: Actuator,
        *,
        inbox: WakeInbox | None = None,
        metrics: AutoscalerMetrics | None = None,
        policy: PolicySettings = DEFAULT_POLICY,
        settings: ControllerSettings | None = None,
        leadership: Leadership | None = None,
        clock: Callable[[], float] = time.time,
        on_decision: Callable[[Target, Decision], None] | None = None,
    ) -> None:
        """``on_decision`` sees every decision before it is applied (local mode's view shows them)."""
        self.deployments = deployments
        self.source = source
        self.actuator = actuator
        self.inbox = inbox or WakeInbox()
        self.metrics = metrics or AutoscalerMetrics()
        self.policy = policy
        self.settings = settings or ControllerSettings()
        self.leadership = leadership
        self.clock = clock
        self.on_decision = on_decision
        self._states: dict[str, PolicyState] = {}
        self._written: dict[str, _Written] = {}
        self._known: dict[str, Scaled] = {}
        self._failing: set[str] = set()

    def _leading(self) -> bool:
        leading = self.leadership is None or self.leadership.is_leader
        self.metrics.is_leader.set(1 if leading else 0)
        if not leading and self._states:
            self._states.clear()  # another replica acts now; our history is no longer ours
            self._written.clear()
        return leading

    async def _listing(self) -> list[Scaled] | None:
        try:
            items = (await self.deployments.list())[: self.settings.max_deployments]
        except DeploymentsUnavailable as e:
            log.warning("cannot list deployments (%s); skipping this tick", e)
            return None
        listed = {s.target.key: s for s in items}
        for key in set(self._known) - set(listed):
            self._forget(key)
        self._known = listed
        return items

    def _forget(self, key: str) -> None:
        gone = self._known.pop(key, None)
        self._states.pop(key, None)
        self._written.pop(key, None)
        self._failing.discard(key)
        if gone is not None:
            self.metrics.forget(gone.target.namespace, gone.target.served_name)

    async def tick(self, wakes: set[tuple[str, str]] | None = None, only_woken: bool = False) -> list[Decision]:
        """Decide for every deployment (or only the woken ones) and apply what changed."""
        if not self._leading():
            return []
        woken = {f"{ns}/{name}" for ns, name in (wakes or set())}
        if only_woken and woken <= set(self._known):
            items = [self._known[k] for k in woken]  # fast path: no listing round trip
        else:
            listing = await self._listing()
            if listing is None:
                return []
            items = [s for s in listing if s.target.key in woken] if only_woken else listing
        for key in woken - set(self._known):
            log.info("wake for %s ignored: no autoscaled InferenceDeployment of that name", key)
        limit = asyncio.Semaphore(self.settings.max_concurrent_observations)

        async def one(scaled: Scaled) -> Decision | None:
            async with limit:
                observation = await self.source.observe(scaled.target, self.clock())
            if scaled.target.key in woken:
                observation = observation.with_wake()
            return await self._decide_and_apply(scaled, observation)

        results = await asyncio.gather(*(one(s) for s in items), return_exceptions=True)
        decisions = []
        for scaled, result in zip(items, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                log.error("deciding for %s failed", scaled.target.key, exc_info=result)
            elif result is not None:
                decisions.append(result)
        return decisions

    async def _decide_and_apply(self, scaled: Scaled, observation: Observation) -> Decision | None:
        key, model = scaled.target.key, scaled.target.served_name
        now = self.clock()
        state = self._states.get(key) or initial_state(scaled.current_replicas, now)
        decision = decide(observation, state, scaled.spec, now, self.policy)
        self._states[key] = decision.state
        self._log_staleness(key, state, decision)
        if self.on_decision is not None:
            self.on_decision(scaled.target, decision)
        labels = (scaled.target.namespace, model)
        self.metrics.desired_replicas.labels(*labels).set(decision.desired_replicas)
        self.metrics.max_replicas.labels(*labels).set(scaled.spec.max_replicas)
        self.metrics.decisions.labels(*labels, decision.reason).inc()
        self.metrics.metrics_stale.labels(*labels).set(1 if decision.state.stale_since_s is not None else 0)

        written = self._written.get(key)
        before = written.desired if written is not None else scaled.status_desired
        count_changed = decision.desired_replicas != before
        reason_due = (
            written is not None
            and decision.reason != written.reason
            and now - written.at_s >= self.settings.reason_refresh_s
        )
        if not count_changed and not reason_due:
            if written is None:
                stamp = datetime.fromtimestamp(now, UTC)
                self._written[key] = _Written(decision.desired_replicas, decision.reason, now, stamp)
            return decision
        last_scale_time = (
            datetime.fromtimestamp(now, UTC) if count_changed or written is None else written.last_scale_time
        )
        command = ScaleCommand(decision.desired_replicas, f"{decision.reason}: {decision.detail}", last_scale_time)
        try:
            await self.actuator.apply(scaled.target, command)
        except TargetGone:
            log.info("%s is gone; forgetting it", key)
            self._forget(key)
            return decision
        except ActuatorError as e:
            if key not in self._failing:
                log.warning("%s: cannot apply %d replicas (%s); retrying every tick", key, command.desired_replicas, e)
                self._failing.add(key)
            return decision
        if key in self._failing:
            log.info("%s: applying decisions works again", key)
            self._failing.discard(key)
        self._written[key] = _Written(decision.desired_replicas, decision.reason, now, last_scale_time)
        if count_changed:
            log.info(
                "%s: %s -> %d replicas (%s: %s)",
                key,
                before,
                decision.desired_replicas,
                decision.reason,
                decision.detail,
            )
        return decision

    @staticmethod
    def _log_staleness(key: str, before: PolicyState, decision: Decision) -> None:
        started, now_stale = before.stale_since_s, decision.state.stale_since_s
        if started is None and now_stale is not None:
            log.warning("%s: metrics stale, holding %d replicas: %s", key, decision.desired_replicas, decision.detail)
        elif started is not None and now_stale is None:
            log.info("%s: metrics fresh again", key)

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``tick_interval_s``; decide at once for woken deployments in between."""
        next_tick = self.clock()
        while not stop.is_set():
            await self.tick(wakes=self.inbox.take())
            next_tick += self.settings.tick_interval_s
            while not stop.is_set():
                remaining = next_tick - self.clock()
                if remaining <= 0:
                    break
                waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.inbox.event.wait())}
                try:
                    await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()
                if self.inbox.event.is_set() and not stop.is_set():
                    await self.tick(wakes=self.inbox.take(), only_woken=True)
            next_tick = max(next_tick, self.clock() - self.settings.tick_interval_s)
