"""Shared fixtures. Component fixtures that start real local servers (Prometheus, moto's S3
server, KMock, engine processes) live in the component's own conftest, in tests/support/ (helpers
only tests use) or in kvfleet_testkit (testkit/: helpers the benchmarks share)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.free_port import pick_free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def free_port() -> Iterator[int]:
    yield pick_free_port()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests with a reason when no CUDA device is present."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU either way
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
