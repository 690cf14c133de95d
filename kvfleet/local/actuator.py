"""The process actuator: keeps each deployment's engine processes at the desired count.

It plays the operator's part in local mode. Scaling up spawns engines on free ports and adds
them to the router only once ``/health`` answers 200. Scaling down marks the replica draining
in the router (no new requests), waits for its in-flight requests, then SIGTERMs it (the engine
finishes anything left and exits). A replica that dies is taken out of the router at once and
replaced after a bounded backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from kvfleet.autoscaler.sources import SourceError
from kvfleet.free_port import pick_free_port, pick_free_port_pair
from kvfleet.local.processes import ChildProcess, ProcessStartError, spawn, wait_healthy
from kvfleet.local.replicas import ReplicaState, ReplicaView, plan_scale, restart_backoff_s
from kvfleet.local.settings import ProcessSettings

log = logging.getLogger(__name__)

# Events kept per deployment for the status view; older ones are dropped.
MAX_EVENTS = 50


class ReplicaRegistry(Protocol):
    """Where the router learns replicas (the router's local ReplicaSource, adapted)."""

    def add(self, deployment: str, replica_id: str, url: str, kv_events_port: int | None = None) -> None: ...

    def mark_draining(self, deployment: str, replica_id: str) -> None: ...

    def remove(self, deployment: str, replica_id: str) -> None: ...

    def inflight(self, deployment: str, replica_id: str) -> int:
        """Requests the router has sent to the replica and not yet finished."""
        ...


# argv for one engine replica listening on ``port`` and publishing its KV-cache events on the
# second port (None: it publishes none).
CommandFactory = Callable[[int, int | None], Sequence[str]]
EventSink = Callable[[str, str], None]


@dataclass
class Replica:
    replica_id: str
    port: int
    state: ReplicaState
    started_at_s: float
    child: ChildProcess | None = None
    ready_at_s: float | None = None
    kv_events_port: int | None = None
    task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class ReplicaSnapshot:
    replica_id: str
    state: ReplicaState
    url: str
    pid: int | None
    age_s: float


@dataclass
class DeploymentProcesses:
    """The engine processes of one deployment and the loop that reconciles them."""

    name: str
    command: CommandFactory
    registry: ReplicaRegistry
    settings: ProcessSettings
    session: aiohttp.ClientSession
    log_dir: Path
    max_replicas: int
    # Engine-side in-flight requests (running + waiting); added to the router's count when draining.
    engine_inflight: Callable[[str], Awaitable[int]] | None = None
    env: Mapping[str, str] | None = None
    # Give each engine a port of its own for its KV-cache events, announced to the router with it.
    kv_events: bool = False
    clock: Callable[[], float] = time.monotonic
    desired: int = 0
    desired_reason: str = "initial"
    replicas: dict[str, Replica] = field(default_factory=dict)
    events: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    consecutive_failures: int = 0
    _next_start_at_s: float = 0.0
    _counter: int = 0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _closing: bool = False
    # Replicas started above ``desired`` while a rolling restart replaces an old one (maxSurge 1).
    _surge: int = 0

    # -- the actuator's interface -------------------------------------------------------------
    def set_desired(self, replicas: int, reason: str) -> None:
        """Ask for ``replicas`` engine processes; acted on by the reconcile loop at once."""
        if replicas != self.desired:
            self._event(f"desired {self.desired} -> {replicas}: {reason}")
        self.desired, self.desired_reason = replicas, reason
        self._wake.set()

    async def rolling_restart(self, reason: str) -> None:
        """Replace every ready replica, one at a time, as a Deployment's RollingUpdate with maxSurge 1
        and maxUnavailable 0 does: start a new replica, and once it is ready drain an old one (no new
        requests; in-flight ones finish, up to ``drain_wait_s``, then SIGTERM). Serving capacity never
        drops below ``desired``. Raises ``ProcessStartError`` when a new replica does not become ready."""
        old = [r for r in sorted(self.replicas.values(), key=lambda r: r.started_at_s) if r.state == "ready"]
        self._event(f"rolling restart of {len(old)} replicas: {reason}")
        for replica in old:
            if replica.state != "ready" or self._closing:
                continue  # died or drained meanwhile: the reconcile loop has replaced it already
            self._surge = 1
            self._wake.set()
            budget_s = (
                self.settings.ready_timeout_s * self.settings.start_attempts + 5 * self.settings.restart_backoff_max_s
            )
            deadline_s = self.clock() + budget_s
            try:
                # Ready without the old one: draining it then leaves ``desired`` ready (maxUnavailable 0).
                while sum(r.state == "ready" and r is not replica for r in self.replicas.values()) < self.desired:
                    if self.clock() > deadline_s or self._closing:
                        raise ProcessStartError(f"rolling restart: no new replica ready within {budget_s:g} s")
                    await asyncio.sleep(self.settings.health_poll_interval_s)
            finally:
                self._surge = 0
            if replica.state != "ready":
                continue
            # In the same step as dropping the surge, so the reconcile loop sees ``desired`` live replicas.
            self._event(f"drain {replica.replica_id}: rolling restart")
            replica.state = "draining"
            previous = replica.task
            replica.task = drain = asyncio.create_task(
                self._drain(replica, previous), name=f"drain-{replica.replica_id}"
            )
            await asyncio.shield(drain)
        self._event("rolling restart done")

    def snapshot(self) -> list[ReplicaSnapshot]:
        now = self.clock()
        return [
            ReplicaSnapshot(
                replica_id=r.replica_id,
                state=r.state,
                url=r.url,
                pid=r.child.pid if r.child else None,
                age_s=round(now - r.started_at_s, 1),
            )
            for r in sorted(self.replicas.values(), key=lambda r: r.started_at_s)
        ]

    def count(self, state: ReplicaState) -> int:
        return sum(1 for r in self.replicas.values() if r.state == state)

    def ready_urls(self) -> list[str]:
        return [r.url for r in self.replicas.values() if r.state == "ready"]

    def all_urls(self) -> list[str]:
        return [r.url for r in self.replicas.values()]

    # -- the loop -----------------------------------------------------------------------------
    async def run(self, poll_interval_s: float = 1.0) -> None:
        """Reconcile until cancelled; wakes on every change and at least every ``poll_interval_s``."""
        while not self._closing:
            self._wake.clear()
            self._reconcile()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), poll_interval_s)

    def _reconcile(self) -> None:
        views = [
            ReplicaView(r.replica_id, r.state, self.registry.inflight(self.name, r.replica_id), r.started_at_s)
            for r in self.replicas.values()
        ]
        plan = plan_scale(views, self.desired + self._surge, self.max_replicas + self._surge)
        for replica_id in plan.drain:
            self._event(f"drain {replica_id}: {plan.reason}")
            replica = self.replicas[replica_id]
            replica.state = "draining"
            previous = replica.task
            replica.task = asyncio.create_task(self._drain(replica, previous), name=f"drain-{replica_id}")
        if plan.start:
            now = self.clock()
            if now < self._next_start_at_s:
                # Backing off after failures; the loop comes back within poll_interval_s.
                return
            for _ in range(plan.start):
                self._start_one(plan.reason)

    def _start_one(self, reason: str) -> None:
        self._counter += 1
        replica_id = f"{self.name}-{self._counter}"
        replica = Replica(replica_id=replica_id, port=0, state="starting", started_at_s=self.clock())
        self.replicas[replica_id] = replica
        self._event(f"start {replica_id}: {reason}")
        replica.task = asyncio.create_task(self._run_replica(replica), name=f"replica-{replica_id}")

    async def _run_replica(self, replica: Replica) -> None:
        try:
            await self._start_until_ready(replica)
        except ProcessStartError as e:
            self._failed(replica, f"{replica.replica_id} failed to start: {e}")
            return
        if replica.state != "starting":  # drained while starting
            return
        replica.state, replica.ready_at_s = "ready", self.clock()
        self.consecutive_failures = 0
        self.registry.add(self.name, replica.replica_id, replica.url, replica.kv_events_port)
        took_s = replica.ready_at_s - replica.started_at_s
        self._event(f"{replica.replica_id} ready on {replica.url} after {took_s:.1f} s")
        assert replica.child is not None
        code = await replica.child.process.wait()
        if replica.state == "ready":  # not a drain we asked for: it died
            self.registry.remove(self.name, replica.replica_id)
            replica.child.close_log()
            self._failed(replica, f"{replica.replica_id} exited unexpectedly with code {code}; replacing it")

    def _events_port(self, http_port: int) -> int | None:
        if not self.kv_events:
            return None
        # Two more free ports, the events' and their replay socket's (the next one); a taken one makes the
        # engine exit at once, and the start is retried.
        for _ in range(10):
            try:
                port = pick_free_port_pair()
            except OSError:
                break
            if http_port not in (port, port + 1):
                return port
        raise ProcessStartError("no free ports for the KV-cache events and their replay")

    async def _start_until_ready(self, replica: Replica) -> None:
        s = self.settings
        last: ProcessStartError | None = None
        for attempt in range(1, s.start_attempts + 1):
            replica.port = pick_free_port()
            replica.kv_events_port = self._events_port(replica.port)
            log_path = self.log_dir / f"{replica.replica_id}.log"
            replica.child = await spawn(self.command(replica.port, replica.kv_events_port), log_path, self.env)
            try:
                await wait_healthy(
                    replica.child,
                    f"{replica.url}/health",
                    self.session,
                    timeout_s=s.ready_timeout_s,
                    poll_interval_s=s.health_poll_interval_s,
                    request_timeout_s=s.health_request_timeout_s,
                )
                return
            except ProcessStartError as e:
                last = e
                exited_by_itself = replica.child.returncode is not None
                await replica.child.stop(s.term_grace_s)
                if replica.state != "starting":
                    raise ProcessStartError("drained while starting") from e
                # Only an early exit may be a lost port race; a timeout will not get better.
                if not exited_by_itself:
                    break
                log.info("%s start attempt %d failed: %s", replica.replica_id, attempt, e)
            except asyncio.CancelledError:
                await replica.child.stop(s.term_grace_s)
                raise
        assert last is not None
        raise last

    def _failed(self, replica: Replica, message: str) -> None:
        self.replicas.pop(replica.replica_id, None)
        if replica.state == "draining":
            return
        self.consecutive_failures += 1
        delay = restart_backoff_s(
            self.consecutive_failures, self.settings.restart_backoff_initial_s, self.settings.restart_backoff_max_s
        )
        self._next_start_at_s = self.clock() + delay
        self._event(f"{message} (next start in {delay:.1f} s)")
        self._wake.set()

    async def _drain(self, replica: Replica, previous: asyncio.Task[None] | None) -> None:
        try:
            if replica.ready_at_s is not None:
                self.registry.mark_draining(self.name, replica.replica_id)
                await self._wait_idle(replica)
            elif previous is not None and not previous.done():
                # Still starting: cancelling the start stops the child it spawned.
                await _cancel(previous)
            if replica.child is not None and replica.child.returncode is None:
                code = await replica.child.stop(self.settings.term_grace_s)
                self._event(f"{replica.replica_id} stopped (exit {code})")
            if previous is not None and not previous.done():
                await _cancel(previous)
        finally:
            if replica.ready_at_s is not None:  # the router never saw a replica that was not ready
                self.registry.remove(self.name, replica.replica_id)
            self.replicas.pop(replica.replica_id, None)
            self._wake.set()

    async def _wait_idle(self, replica: Replica) -> None:
        deadline = self.clock() + self.settings.drain_wait_s
        while self.clock() < deadline:
            if replica.child is not None and replica.child.returncode is not None:
                return
            inflight = self.registry.inflight(self.name, replica.replica_id)
            if self.engine_inflight is not None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, SourceError):
                    inflight += await self.engine_inflight(replica.url)
            if inflight == 0:
                return
            await asyncio.sleep(self.settings.health_poll_interval_s)
        self._event(f"{replica.replica_id}: still busy after {self.settings.drain_wait_s:g} s of draining; stopping")

    async def shutdown(self, force: asyncio.Event | None = None) -> None:
        """Drain every replica (SIGTERM, wait) unless ``force`` is set, which kills them at once."""
        self._closing = True
        self._wake.set()
        self.desired = 0
        for replica in list(self.replicas.values()):
            if replica.state != "draining":
                replica.state = "draining"
                replica.task = asyncio.create_task(self._drain(replica, replica.task))
        tasks = [r.task for r in self.replicas.values() if r.task is not None]
        if not tasks:
            return

        async def all_stopped() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)

        waiter = asyncio.create_task(all_stopped())
        if force is None:
            await waiter
            return
        forced = asyncio.create_task(force.wait())
        try:
            await asyncio.wait([waiter, forced], return_when=asyncio.FIRST_COMPLETED)
            if force.is_set():
                self.kill_all()
            await waiter
        finally:
            forced.cancel()

    def kill_all(self) -> None:
        """SIGKILL every engine process group now (the forced path; also safe after shutdown)."""
        for replica in list(self.replicas.values()):
            if replica.child is not None:
                replica.child.kill()

    def _event(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.events.append(f"{stamp} {message}")
        log.info("%s: %s", self.name, message)


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it; our own cancellation still propagates."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
