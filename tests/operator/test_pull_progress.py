"""The operator's reading of launchers' /progress: which pods it asks (pure), what it makes of
their answers (pure), and a tenant's pod that answers outside the contract (real HTTP)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from kvfleet.operator.pull_progress import (
    MAX_PROGRESS_BYTES,
    PodAddress,
    PullProgressProbe,
    PullsSeen,
    parse_progress,
    pods_to_ask,
    summarize,
)
from kvfleet.pull_progress import PullReport

GB = 10**9


def pod(name: str, *, ready: bool = False, running: bool = True, ip: str | None = "127.0.0.1", **meta: Any) -> Any:
    state = (
        {"running": {"startedAt": "2026-01-01T00:00:00Z"}} if running else {"waiting": {"reason": "PodInitializing"}}
    )
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "engine", "state": state}],
    }
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, **meta}, "status": status}


def report(done_gb: float, total_gb: float = 140, rate: float | None = None, eta: float | None = None) -> PullReport:
    done = int(done_gb * GB)
    return PullReport(int(total_gb * GB), done, done, rate, eta)


def test_only_running_unready_pods_with_an_ip_are_asked() -> None:
    pods = [
        pod("m-engine-c"),
        pod("m-engine-a"),
        pod("m-engine-ready", ready=True),  # serving: its pull is long over
        pod("m-engine-creating", running=False),  # no launcher yet
        pod("m-engine-no-ip", ip=None),
        pod("m-engine-leaving", deletionTimestamp="2026-01-01T00:00:00Z"),
    ]
    assert pods_to_ask(pods) == [PodAddress("m-engine-a", "127.0.0.1"), PodAddress("m-engine-c", "127.0.0.1")]


@pytest.mark.parametrize(
    ("doc", "pulling"),
    [
        ({"phase": "pull", "pull": report(58).to_doc()}, True),
        ({"phase": "engine_start", "pull": report(140).to_doc()}, False),  # pulled; the engine is starting
        ({"phase": "pull", "pull": None}, False),  # a node-cache lock wait: nothing moves yet
        ({"phase": "pull", "pull": {"totalBytes": 10, "doneBytes": 11}}, False),
        ("pulling", False),
    ],
)
def test_only_a_running_pull_counts(doc: Any, pulling: bool) -> None:
    assert (parse_progress(doc) is not None) is pulling


def test_the_least_advanced_pull_speaks_for_the_rollout() -> None:
    assert summarize([]) is None
    one = summarize([report(58.8, rate=1.2 * GB, eta=(140 - 58.8) / 1.2)])
    assert one is not None and one.message() == "pulling 42% (58/140 GB), 1.20 GB/s, 1m08s left"
    # Same percent: the one with more bytes still to move is slower.
    seen = summarize([report(100), report(30), report(3, total_gb=7), report(60)])
    assert seen == PullsSeen(pulling=4, slowest=report(30))
    assert seen.message() == "pulling 21% (30/140 GB) (the slowest of 4 pods pulling)"


async def serve(port: int, body: bytes, status: int = 200) -> web.AppRunner:
    async def progress(request: web.Request) -> web.Response:
        return web.Response(body=body, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_get("/progress", progress)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.mark.parametrize(
    ("body", "status", "pulling"),
    [
        (json.dumps({"phase": "pull", "pull": report(58).to_doc()}).encode(), 200, True),
        # Valid JSON and a valid report, but far over the bound: refused without being parsed.
        (
            json.dumps({"phase": "pull", "pull": report(58).to_doc(), "pad": "x" * MAX_PROGRESS_BYTES}).encode(),
            200,
            False,
        ),
        (b"not json", 200, False),
        (json.dumps({"phase": "pull", "pull": report(58).to_doc()}).encode(), 503, False),
    ],
    ids=["ok", "oversized", "garbage", "error-status"],
)
async def test_probe_reads_a_bounded_answer(free_port: int, body: bytes, status: int, pulling: bool) -> None:
    runner = await serve(free_port, body, status)
    try:
        probe = PullProgressProbe(port=free_port, timeout_s=2, pods_per_tick=8)
        seen = await probe.read([pod("m-engine-a")])
        assert (seen is not None) is pulling
        if seen is not None:
            assert seen.slowest == report(58)
    finally:
        await runner.cleanup()


async def test_probe_asks_no_one_when_no_pod_qualifies(free_port: int) -> None:
    asked: list[str] = []

    async def progress(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"phase": "pull", "pull": report(1).to_doc()})

    app = web.Application()
    app.router.add_get("/progress", progress)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    try:
        probe = PullProgressProbe(port=free_port, timeout_s=2, pods_per_tick=2)
        assert await probe.read([pod("ready", ready=True), pod("creating", running=False)]) is None
        assert asked == []
        # Three candidates, two asked per tick.
        seen = await probe.read([pod("a"), pod("b"), pod("c")])
        assert seen is not None and seen.pulling == 2 and len(asked) == 2
    finally:
        await runner.cleanup()
