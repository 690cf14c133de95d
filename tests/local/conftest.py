"""Fixtures for local mode's tests: an actuator over real child processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from support.local_support import RecordingRegistry

from kvfleet.autoscaler.engine_metrics import scrape_engine, total_inflight
from kvfleet.local.actuator import DeploymentProcesses
from kvfleet.local.settings import ProcessSettings

FAST = ProcessSettings(
    ready_timeout_s=20,
    health_poll_interval_s=0.05,
    drain_wait_s=20,
    term_grace_s=10,
    restart_backoff_initial_s=0.2,
    restart_backoff_max_s=1.0,
)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def make_processes(tmp_path: Path, session: aiohttp.ClientSession):  # type: ignore[no-untyped-def]
    created: list[DeploymentProcesses] = []

    async def engine_inflight(url: str) -> int:
        return total_inflight([await scrape_engine(session, url)])

    def make(command: object, max_replicas: int = 4, settings: ProcessSettings = FAST) -> DeploymentProcesses:
        procs = DeploymentProcesses(
            name="tiny",
            command=command,  # type: ignore[arg-type]
            registry=RecordingRegistry(),
            settings=settings,
            session=session,
            log_dir=tmp_path / "logs",
            max_replicas=max_replicas,
            engine_inflight=engine_inflight,
        )
        created.append(procs)
        return procs

    yield make
    for procs in created:
        procs.kill_all()
