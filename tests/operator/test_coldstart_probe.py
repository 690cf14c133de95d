"""The operator's /coldstart read from a launcher: a tenant's pod answers, so the body is bounded."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from kvfleet.operator.coldstart import MAX_COLDSTART_BYTES, ColdStartProbe, LauncherReport


def ready_pod(uid: str) -> dict[str, object]:
    return {
        "metadata": {"uid": uid},
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        },
    }


DIGEST = "ab" * 32


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (json.dumps({"totalSeconds": 12.5}).encode(), LauncherReport(12.5, None)),
        (json.dumps({"totalSeconds": 12.5, "modelDigest": DIGEST}).encode(), LauncherReport(12.5, DIGEST)),
        # Only a digest's shape reaches status.
        (json.dumps({"totalSeconds": 1, "modelDigest": "<script>"}).encode(), LauncherReport(1.0, None)),
        # Valid JSON, but far over the bound: refused without being parsed.
        (json.dumps({"totalSeconds": 12.5, "pad": "x" * (10 * MAX_COLDSTART_BYTES)}).encode(), None),
        # Within the bound, nested deeper than the parser goes.
        (b"[" * 2000 + b"]" * 2000, None),
    ],
    ids=["small", "digest", "not-a-digest", "oversized", "deep"],
)
async def test_coldstart_body_is_bounded(free_port: int, body: bytes, expected: LauncherReport | None) -> None:
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


async def test_a_launcher_that_does_not_answer_is_not_asked_again_until_the_retry(free_port: int) -> None:
    """Nothing listens on the port: the pod is asked once, then left alone until the retry interval."""
    from kvfleet.operator.coldstart import UNANSWERED_RETRY_S

    now = [1000.0]
    probe = ColdStartProbe(port=free_port, timeout_s=1, pods_per_tick=4, clock=lambda: now[0])
    pods = [ready_pod("u1"), ready_pod("u2")]
    assert await probe.latest(pods) is None
    assert probe.asked == 2
    now[0] += UNANSWERED_RETRY_S / 2
    assert await probe.latest(pods) is None
    assert probe.asked == 2  # a resync within the interval sends nothing
    now[0] += UNANSWERED_RETRY_S
    assert await probe.latest([*pods, ready_pod("u3")]) is None
    assert probe.asked == 5  # all asked again after it, and a new pod at once
