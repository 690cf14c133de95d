"""The launcher's small HTTP endpoint (port 9400): Prometheus metrics and the cold-start report.

``/metrics`` carries ``kvfleet_coldstart_seconds{phase}`` (phase ``total`` once every phase is
done) and whether each cache hit; ``/coldstart`` is the same as JSON for the operator, which
copies ``totalSeconds`` into ``status.measuredColdStartSeconds`` (503 until it is known). It runs in
the launcher's event loop beside the engine process, so it is up before the first phase starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from .phases import PhaseRecord


class ColdStartMetrics:
    """Prometheus gauges of one launch, in their own registry (tests run several launches)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.phase_seconds = Gauge(
            "kvfleet_coldstart_seconds",
            "Seconds each cold-start phase took (pull, artifacts, engine_start, first_ready, total).",
            ["phase"],
            registry=self.registry,
        )
        self.cache_hit = Gauge(
            "kvfleet_coldstart_cache_hit",
            "1 when the cache served this launch (node: weights already on the node; artifacts: prebuilt).",
            ["cache"],
            registry=self.registry,
        )
        self.artifacts_pushed = Gauge(
            "kvfleet_coldstart_artifacts_pushed",
            "1 once artifacts built by this launch were pushed to the cache after a miss.",
            registry=self.registry,
        )

    def record(self, record: PhaseRecord) -> None:
        self.phase_seconds.labels(phase=record.phase).set(record.seconds)

    def set_total(self, seconds: float) -> None:
        self.phase_seconds.labels(phase="total").set(seconds)

    def set_cache_hit(self, cache: str, hit: bool) -> None:
        self.cache_hit.labels(cache=cache).set(1.0 if hit else 0.0)


def make_app(metrics: ColdStartMetrics, report: Callable[[], dict[str, Any]]) -> web.Application:
    """The endpoint's routes; ``report`` builds the ``/coldstart`` document on each request."""

    async def get_metrics(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_coldstart(request: web.Request) -> web.Response:
        # 503 until the first token was served (the contract); the partial document helps a human.
        doc = report()
        return web.json_response(doc, status=200 if doc.get("complete") else 503)

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/coldstart", get_coldstart)
    return app


async def start_metrics_server(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app``; the caller owns the runner and calls ``cleanup()`` on it."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
