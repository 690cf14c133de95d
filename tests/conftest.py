"""Shared fixtures. Component fixtures that start real local servers (Prometheus, moto's S3
server, KMock, engine processes) live in the component's own conftest, in tests/support/ (helpers
only tests use) or in kvfleet_testkit (testkit/: helpers the benchmarks share)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The real node's session fixtures, defined once here so tests/node and tests/e2e share one cluster.
from support.node_fixtures import (  # noqa: F401
    chart,
    control_plane_image,
    engine_image,
    engine_ready,
    node_binaries,
    prometheus,
    real_node,
    s3_model,
)

from kvfleet.free_port import pick_free_port
from kvfleet_testkit.seaweedfs import SeaweedError, SeaweedS3, seaweedfs_s3_server

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def free_port() -> Iterator[int]:
    yield pick_free_port()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real S3 server (SeaweedFS's ``weed server -s3``, tools/seaweedfs/build.sh) on free loopback
    ports, one per session. Outside CI a test skips with the reason when it cannot be built or
    started; under CI (``CI=true``) that fails."""
    try:
        with seaweedfs_s3_server(tmp_path_factory.mktemp("seaweedfs")) as server:
            yield server
    except SeaweedError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the S3 server (SeaweedFS) could not be started under CI: {e}")
        pytest.skip(f"no S3 server (SeaweedFS; run tools/seaweedfs/build.sh): {e}")


# The tests that use the real node (session fixtures above): one cluster for all of them.
REAL_NODE_TESTS = (REPO_ROOT / "tests" / "node", REPO_ROOT / "tests" / "e2e" / "test_cluster.py")


def _on_real_node(item: pytest.Item) -> int:
    """0: elsewhere; then tests/node, then the e2e test (its namespace is deleted, not awaited)."""
    path = Path(str(item.fspath))
    return next((i + 1 for i, p in enumerate(REAL_NODE_TESTS) if path.is_relative_to(p)), 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the real node's tests last and together (its pods would otherwise run beside every test
    collected between tests/e2e and tests/node); skip ``gpu`` tests with a reason when no CUDA
    device is present."""
    items.sort(key=_on_real_node)  # stable: the order within each part stays
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
