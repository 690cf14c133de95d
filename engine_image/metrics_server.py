"""The launcher's small HTTP endpoint (port 9400): Prometheus metrics, the cold-start report, the
launch's progress and the model's tokenizer files.

``/metrics`` carries ``kvfleet_coldstart_seconds{phase}`` (phase ``total`` once every phase is
done), whether each cache hit, and the weight pull's bytes as they move; ``/coldstart`` is the
cold start as JSON for the operator, which copies ``totalSeconds`` into
``status.measuredColdStartSeconds`` (503 until it is known); ``/progress`` is a small fixed-shape
document (the running phase, and the pull's bytes, rate and time left) that the operator reads
while a pod is not ready, for the Progressing condition; ``/tokenizer/{name}`` serves the model's
``tokenizer.json`` and ``tokenizer_config.json`` (those two only, each up to
``contracts.TOKENIZER_MAX_BYTES``; 503 until the weights are in place), so a router tokenizes
prompts as the engine does without a mounted copy. It runs in the launcher's event loop beside the
engine process, so it is up before the first phase starts.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet.contracts import LAUNCHER_TOKENIZER_PATH, TOKENIZER_FILES, TOKENIZER_MAX_BYTES
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


class TokenizerFileError(Exception):
    """A tokenizer file that cannot be served: the HTTP status and the reason a router logs."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def check_tokenizer_name(name: str) -> None:
    """Only the allowlisted names: nothing else of the model folder (weights, code) leaves the pod."""
    if name not in TOKENIZER_FILES:
        raise TokenizerFileError(404, f"{name!r} is not served: only {', '.join(TOKENIZER_FILES)}")


def read_tokenizer_file(model_dir: Path, name: str, max_bytes: int) -> bytes:
    """One allowlisted file of the model folder, whole, or :class:`TokenizerFileError` (blocking).

    The size is checked on the opened file and the read stops one byte past the bound, so a file
    swapped or grown after the check is still never sent past ``max_bytes``."""
    check_tokenizer_name(name)
    path = model_dir / name
    try:
        if not path.is_file():  # checked before opening: a FIFO there would block the open
            raise FileNotFoundError(path)
        with path.open("rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise FileNotFoundError(path)
            if info.st_size > max_bytes:
                raise TokenizerFileError(413, f"the model's {name} is {info.st_size} bytes, over {max_bytes}")
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise TokenizerFileError(404, f"the model has no {name} (as a regular file)") from None
    except OSError as e:
        raise TokenizerFileError(500, f"cannot read the model's {name}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise TokenizerFileError(413, f"the model's {name} grew past {max_bytes} bytes while read")
    return data


def make_app(
    metrics: ColdStartMetrics,
    report: Callable[[], dict[str, Any]],
    progress: Callable[[], dict[str, Any]],
    model_dir: Callable[[], Path | None] = lambda: None,
    *,
    tokenizer_max_bytes: int = TOKENIZER_MAX_BYTES,
) -> web.Application:
    """The endpoint's routes; ``report`` builds the ``/coldstart`` document and ``progress`` the
    ``/progress`` one, on each request; ``model_dir`` is the folder the engine serves, None until
    the weights are in place."""

    async def get_metrics(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_coldstart(request: web.Request) -> web.Response:
        # 503 until the first token was served (the contract); the partial document helps a human.
        doc = report()
        return web.json_response(doc, status=200 if doc.get("complete") else 503)

    async def get_progress(request: web.Request) -> web.Response:
        return web.json_response(progress())

    async def get_tokenizer(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            check_tokenizer_name(name)
            folder = model_dir()
            if folder is None:
                raise TokenizerFileError(503, "the model's weights are not in place yet")
            # A file of tens of MB: read off the event loop that also serves /metrics.
            data = await asyncio.to_thread(read_tokenizer_file, folder, name, tokenizer_max_bytes)
        except TokenizerFileError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        return web.Response(body=data, content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/coldstart", get_coldstart)
    app.router.add_get("/progress", get_progress)
    app.router.add_get(LAUNCHER_TOKENIZER_PATH + "{name}", get_tokenizer)
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
