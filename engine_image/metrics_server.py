"""The launcher's small HTTP endpoint (port 9400): Prometheus metrics, the cold-start report and
the launch's progress.

``/metrics`` carries ``kvfleet_coldstart_seconds{phase}`` (phase ``total`` once every phase is
done), whether each cache hit, and the weight pull's bytes as they move; ``/coldstart`` is the
cold start as JSON for the operator, which copies ``totalSeconds`` into
``status.measuredColdStartSeconds`` (503 until it is known); ``/progress`` is a small fixed-shape
document (the running phase, and the pull's bytes, rate and time left) that the operator reads
while a pod is not ready, for the Progressing condition. It runs in the launcher's event loop
beside the engine process, so it is up before the first phase starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet.pull_progress import PullReport

from .phases import PhaseRecord


class PullBytesCollector(Collector):
    """The weight pull's bytes, read from the pull's own counters at scrape time (no second count
    kept in the transfer's hot loop). All zero until a pull starts; a node-cache hit moves nothing."""

    def __init__(self, report: Callable[[], PullReport | None]) -> None:
        self._report = report

    def collect(self) -> Iterable[Metric]:
        report = self._report()
        yield CounterMetricFamily(
            "kvfleet_coldstart_pull_downloaded_bytes",
            "Bytes this launch's weight pull moved from the bucket (retried parts count again).",
            value=report.downloaded_bytes if report else 0,
        )
        yield GaugeMetricFamily(
            "kvfleet_coldstart_pull_done_bytes",
            "Bytes of the model in place on the node: already there, resumed, or downloaded now.",
            value=report.done_bytes if report else 0,
        )
        yield GaugeMetricFamily(
            "kvfleet_coldstart_pull_size_bytes",
            "Bytes the model's files hold (0 until the pull read the manifest).",
            value=report.total_bytes if report else 0,
        )

    def describe(self) -> Iterable[Metric]:
        return self.collect()


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
        self.node_cache_refused = Gauge(
            "kvfleet_coldstart_node_cache_refused_files",
            "Files the node cache held for this launch's model but refused (wrong content, size or type) "
            "and fetched again; never loaded.",
            registry=self.registry,
        )
        self.artifacts_pushed = Gauge(
            "kvfleet_coldstart_artifacts_pushed",
            "1 once artifacts built by this launch were pushed to the cache after a miss.",
            registry=self.registry,
        )
        self.artifacts_refused = Counter(
            "kvfleet_coldstart_artifacts_refused",
            "Artifacts found but never loaded, by why (unsigned, untrusted-key, bad-signature, "
            "identity-mismatch, content-mismatch, no-trust) and where (node, bucket).",
            ["reason", "where"],
            registry=self.registry,
        )

    def track_pull(self, report: Callable[[], PullReport | None]) -> None:
        """Export the pull's bytes from ``report`` (called on every scrape)."""
        self.registry.register(PullBytesCollector(report))

    def record(self, record: PhaseRecord) -> None:
        self.phase_seconds.labels(phase=record.phase).set(record.seconds)

    def set_total(self, seconds: float) -> None:
        self.phase_seconds.labels(phase="total").set(seconds)

    def set_cache_hit(self, cache: str, hit: bool) -> None:
        self.cache_hit.labels(cache=cache).set(1.0 if hit else 0.0)


def make_app(
    metrics: ColdStartMetrics,
    report: Callable[[], dict[str, Any]],
    progress: Callable[[], dict[str, Any]],
) -> web.Application:
    """The endpoint's routes; ``report`` builds the ``/coldstart`` document and ``progress`` the
    ``/progress`` one, on each request."""

    async def get_metrics(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_coldstart(request: web.Request) -> web.Response:
        # 503 until the first token was served (the contract); the partial document helps a human.
        doc = report()
        return web.json_response(doc, status=200 if doc.get("complete") else 503)

    async def get_progress(request: web.Request) -> web.Response:
        return web.json_response(progress())

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/coldstart", get_coldstart)
    app.router.add_get("/progress", get_progress)
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
