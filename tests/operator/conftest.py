"""Fixtures: the real kopf operator, in-process, against KMock's Kubernetes API emulator
(extended in testkit/kvfleet_testkit/kube_emulator.py, whose docstring lists each extension)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvfleet_testkit.kube_emulator import (
    Cluster,
    RunningOperator,
    operator_settings,
    serve_cluster,
    start_operator,
    stop_operator,
)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async for served in serve_cluster():
        yield served


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[RunningOperator]:
    running = await start_operator(cluster, operator_settings())
    try:
        yield running
    finally:
        await stop_operator(running)
