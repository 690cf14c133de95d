"""The local API server with real list/watch semantics (tests/support/watch_api.py) that kvfleet.kube's
tests talk to."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from support.watch_api import WatchApi


@pytest.fixture
async def api() -> AsyncIterator[WatchApi]:
    server = WatchApi()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
