"""Local mode's edges of the autoscaler's controller over real engine-like processes: each engine's
/metrics is read once per tick (the view reads the same samples), a wake decides at once, and the
decision reaches the processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from support.local_support import replica_command

from kvfleet.autoscaler.actuators import ScaleCommand, TargetGone
from kvfleet.autoscaler.scrape_source import ScrapeSource, ScrapeSourceSettings
from kvfleet.autoscaler.sources import Target
from kvfleet.autoscaler.wake import WakeInbox
from kvfleet.local.actuator import DeploymentProcesses
from kvfleet.local.control import DeploymentRun, EngineScrape, LocalDeployments, ProcessActuator, local_controller
from kvfleet.resource import InferenceDeployment


def deployment(autoscaling: dict[str, Any] | None, replicas: int | None = None) -> InferenceDeployment:
    spec: dict[str, Any] = {
        "model": {"uri": "file:///models/t", "servedName": "t"},
        "engine": {"kind": "reference"},
        "resources": {"gpus": 0},
    }
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    if replicas is not None:
        spec["replicas"] = replicas
    return InferenceDeployment.model_validate(
        {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "tiny"}, "spec": spec}
    )


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


@pytest.fixture
async def two_replicas(make_processes) -> AsyncIterator[DeploymentProcesses]:  # type: ignore[no-untyped-def]
    procs: DeploymentProcesses = make_processes(replica_command())
    task = asyncio.create_task(procs.run(poll_interval_s=0.1))
    procs.set_desired(2, "test")
    try:
        await until(lambda: procs.count("ready") == 2)
        yield procs
    finally:
        await procs.shutdown()
        task.cancel()


async def scrapes(session: aiohttp.ClientSession, procs: DeploymentProcesses) -> dict[str, int]:
    counts = {}
    for replica_id, replica in procs.replicas.items():
        async with session.get(f"{replica.url}/scrapes") as response:
            counts[replica_id] = int(await response.text())
    return counts


async def test_each_engine_is_scraped_once_per_tick_and_the_view_sees_it(
    two_replicas: DeploymentProcesses, session: aiohttp.ClientSession
) -> None:
    run = DeploymentRun(deployment({"minReplicas": 2, "maxReplicas": 2}), two_replicas)
    runs = {"tiny": run}
    source = EngineScrape(runs, session, ScrapeSource(ScrapeSourceSettings(), session))
    inbox = WakeInbox()
    controller = local_controller(runs, source, inbox, tick_s=1.0)
    before = await scrapes(session, two_replicas)
    assert len(before) == 2
    ticks = 5
    for _ in range(ticks):
        await controller.tick()
    # A wake decides at once, in a tick of its own: one more read of each engine.
    inbox.request("default", "tiny")
    await controller.tick(wakes=inbox.take(), only_woken=True)
    after = await scrapes(session, two_replicas)
    assert {r: after[r] - before[r] for r in after} == {r: ticks + 1 for r in after}
    # The view's window holds those same samples: both replicas' gauges, no scrape of its own.
    assert run.window.stats().running == 0.0
    assert run.window.replicas == set(after)
    assert run.decision is not None


async def test_a_wake_at_zero_starts_a_replica_through_the_process_actuator(
    make_processes,  # type: ignore[no-untyped-def]
    session: aiohttp.ClientSession,
) -> None:
    procs: DeploymentProcesses = make_processes(replica_command())
    task = asyncio.create_task(procs.run(poll_interval_s=0.1))
    try:
        run = DeploymentRun(deployment({"minReplicas": 0, "maxReplicas": 2}), procs)
        runs = {"tiny": run}
        inbox = WakeInbox()
        controller = local_controller(
            runs, EngineScrape(runs, session, ScrapeSource(ScrapeSourceSettings(), session)), inbox, 1.0
        )
        await controller.tick()
        assert procs.desired == 0 and not procs.replicas  # nothing asked for a replica yet
        inbox.request("default", "tiny")
        await controller.tick(wakes=inbox.take(), only_woken=True)
        assert procs.desired == 1
        assert run.last_scaling is not None and run.last_scaling.reason == "wake", run.last_scaling
        await until(lambda: procs.count("ready") == 1)
    finally:
        await procs.shutdown()
        task.cancel()


async def test_fixed_replicas_are_not_the_controllers_and_unknown_targets_are_gone(
    make_processes,  # type: ignore[no-untyped-def]
) -> None:
    procs: DeploymentProcesses = make_processes(replica_command())
    runs = {"tiny": DeploymentRun(deployment(None, replicas=2), procs)}
    assert await LocalDeployments(runs).list() == []
    actuator = ProcessActuator(runs)
    with pytest.raises(TargetGone, match="default/other is not a local deployment"):
        await actuator.apply(Target("default", "other", "t"), ScaleCommand(1, "scale_up: test", datetime.now(UTC)))
    await actuator.apply(runs["tiny"].target(), ScaleCommand(3, "scale_up: test", datetime.now(UTC)))
    assert (procs.desired, procs.desired_reason) == (3, "scale_up: test")
