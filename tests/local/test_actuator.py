"""The process actuator over real child processes: start, ready, drain, death, no orphans."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from support.local_support import RecordingRegistry, replica_command

from kvfleet.local.actuator import DeploymentProcesses


@contextlib.asynccontextmanager
async def running(procs: DeploymentProcesses) -> AsyncIterator[DeploymentProcesses]:
    task = asyncio.create_task(procs.run(poll_interval_s=0.1))
    try:
        yield procs
    finally:
        await procs.shutdown()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_scale_up_adds_replicas_only_when_healthy_and_down_stops_them(make_processes) -> None:
    procs = make_processes(replica_command("--ready-after-s", "0.5"))
    registry: RecordingRegistry = procs.registry
    async with running(procs):
        procs.set_desired(2, "test asks for 2")
        await until(lambda: procs.count("starting") == 2)
        assert registry.active == {}  # not ready yet: the router must not see them
        await until(lambda: procs.count("ready") == 2)
        assert len(registry.active) == 2
        pids = [s.pid for s in procs.snapshot()]
        assert all(pid is not None and alive(pid) for pid in pids)
        procs.set_desired(0, "idle")
        await until(lambda: not procs.replicas)
        assert registry.active == {}
        assert not any(alive(pid) for pid in pids if pid is not None)
    kinds = [kind for kind, _ in registry.history]
    assert kinds.count("add") == 2 and kinds.count("draining") == 2 and kinds.count("remove") == 2


async def test_scale_down_drains_in_flight_request_before_stopping(
    make_processes, session: aiohttp.ClientSession
) -> None:
    procs = make_processes(replica_command())
    registry: RecordingRegistry = procs.registry
    async with running(procs):
        procs.set_desired(1, "one")
        await until(lambda: procs.count("ready") == 1)
        url = procs.ready_urls()[0]
        pid = procs.snapshot()[0].pid
        assert pid is not None
        request = asyncio.create_task(session.post(f"{url}/slow?seconds=1.5"))
        await asyncio.sleep(0.3)  # the request is in the engine now
        procs.set_desired(0, "idle")
        await until(lambda: procs.count("draining") == 1)
        assert registry.draining  # the router was told before anything was stopped
        response = await request
        assert response.status == 200 and await response.text() == "done"
        await until(lambda: not procs.replicas)
        assert not alive(pid)
    history = registry.history
    assert history.index(("draining", "tiny-1")) < history.index(("remove", "tiny-1"))


async def test_router_inflight_holds_the_drain(make_processes) -> None:
    procs = make_processes(replica_command())
    registry: RecordingRegistry = procs.registry
    async with running(procs):
        procs.set_desired(1, "one")
        await until(lambda: procs.count("ready") == 1)
        registry.router_inflight["tiny-1"] = 1  # sent by the router, not yet at the engine
        procs.set_desired(0, "idle")
        await asyncio.sleep(0.5)
        assert procs.count("draining") == 1 and procs.snapshot()[0].pid is not None
        registry.router_inflight["tiny-1"] = 0
        await until(lambda: not procs.replicas)


async def test_killed_replica_is_removed_and_replaced(make_processes) -> None:
    procs = make_processes(replica_command())
    registry: RecordingRegistry = procs.registry
    async with running(procs):
        procs.set_desired(2, "two")
        await until(lambda: procs.count("ready") == 2)
        victim = procs.snapshot()[0]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        await until(lambda: victim.replica_id not in registry.active)
        await until(lambda: procs.count("ready") == 2 and victim.replica_id not in procs.replicas)
        assert len(registry.active) == 2
        assert any("exited unexpectedly with code -9" in e for e in procs.events)


async def test_failing_engine_backs_off_and_reports_why(make_processes) -> None:
    procs = make_processes(replica_command("--exit-code", "3"))
    async with running(procs):
        procs.set_desired(1, "one")
        await until(lambda: sum("failed to start" in e for e in procs.events) >= 2)
        assert procs.consecutive_failures >= 2
        assert any("exited with code 3 before it was ready" in e for e in procs.events)
        assert procs.registry.active == {}


async def test_drain_while_starting_stops_the_child(make_processes) -> None:
    procs = make_processes(replica_command("--ready-after-s", "30"))
    async with running(procs):
        procs.set_desired(1, "one")
        await until(lambda: procs.count("starting") == 1 and procs.snapshot()[0].pid is not None)
        pid = procs.snapshot()[0].pid
        assert pid is not None
        procs.set_desired(0, "never mind")
        await until(lambda: not procs.replicas)
        assert not alive(pid)
        assert procs.registry.history == []  # the router never saw it


@pytest.mark.parametrize("forced", [False, True])
async def test_shutdown_leaves_no_process(make_processes, session: aiohttp.ClientSession, forced: bool) -> None:
    procs = make_processes(replica_command())
    task = asyncio.create_task(procs.run(poll_interval_s=0.1))
    procs.set_desired(2, "two")
    await until(lambda: procs.count("ready") == 2)
    pids = [s.pid for s in procs.snapshot() if s.pid is not None]
    url = procs.ready_urls()[0]
    seconds = 30 if forced else 1.5
    request = asyncio.create_task(session.post(f"{url}/slow?seconds={seconds}"))
    await asyncio.sleep(0.3)
    force = asyncio.Event()
    if forced:
        # The second Ctrl-C: nothing is waited for.
        force.set()
        await asyncio.wait_for(procs.shutdown(force), 10)
        with pytest.raises(aiohttp.ClientError):
            await request
    else:
        # Graceful: the in-flight request is finished before its engine stops.
        await asyncio.wait_for(procs.shutdown(force), 20)
        response = await request
        assert response.status == 200
    await task
    assert not any(alive(pid) for pid in pids)


async def test_rolling_restart_replaces_every_replica_without_dropping_capacity_or_requests(
    make_processes, session: aiohttp.ClientSession
) -> None:
    procs = make_processes(replica_command("--ready-after-s", "0.3"))
    registry: RecordingRegistry = procs.registry
    async with running(procs):
        procs.set_desired(2, "two")
        await until(lambda: procs.count("ready") == 2)
        old = set(procs.replicas)
        requests = [asyncio.create_task(session.post(f"{url}/slow?seconds=1.5")) for url in procs.ready_urls()]
        await asyncio.sleep(0.2)  # both requests are in the engines now
        least_ready = 2

        async def watch() -> None:
            nonlocal least_ready
            while True:
                least_ready = min(least_ready, len(registry.active))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        await procs.rolling_restart("new engine args")
        watcher.cancel()
        for request in requests:
            response = await request
            assert response.status == 200 and await response.text() == "done"
        assert procs.count("ready") == 2 and not set(procs.replicas) & old
        assert least_ready == 2  # maxUnavailable 0: the router always had two replicas to send to
    history = registry.history
    # Each old replica was drained only after its replacement was added.
    assert history.index(("add", "tiny-3")) < history.index(("draining", "tiny-1"))
    assert history.index(("add", "tiny-4")) < history.index(("draining", "tiny-2"))
