"""The operator's /coldstart read from a launcher: a tenant's pod answers, so the body is bounded."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from kvfleet.operator.coldstart import MAX_COLDSTART_BYTES, ColdStartProbe


def ready_pod(uid: str) -> dict[str, object]:
    return {
        "metadata": {"uid": uid},
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        },
    }


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (json.dumps({"totalSeconds": 12.5}).encode(), 12.5),
        # Valid JSON, but far over the bound: refused without being parsed.
        (json.dumps({"totalSeconds": 12.5, "pad": "x" * (10 * MAX_COLDSTART_BYTES)}).encode(), None),
    ],
    ids=["small", "oversized"],
)
async def test_coldstart_body_is_bounded(free_port: int, body: bytes, expected: float | None) -> None:
    async def coldstart(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/coldstart", coldstart)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    try:
        probe = ColdStartProbe(port=free_port, timeout_s=5, pods_per_tick=4)
        assert await probe.latest([ready_pod("u1")]) == expected
    finally:
        await runner.cleanup()
