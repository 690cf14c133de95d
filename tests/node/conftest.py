"""The ``node`` marker for every test here. The real node and what runs on it are session fixtures
in tests/support/node_fixtures.py (registered by tests/conftest.py, so tests/e2e shares the one
cluster a session starts)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.node)
