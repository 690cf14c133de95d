"""The autoscaler's HTTP endpoint: ``POST /v1/wake``, ``GET /metrics``, ``GET /healthz``."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvfleet.autoscaler.metrics import AutoscalerMetrics
from kvfleet.autoscaler.wake import WakeInbox, WakeToken, wake_handler


def build_app(inbox: WakeInbox, metrics: AutoscalerMetrics, wake_token: WakeToken | None = None) -> web.Application:
    async def metrics_handler(_: web.Request) -> web.Response:
        # The text format always: names keep their colons and underscores as written.
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=64 * 1024)
    app.router.add_post("/v1/wake", wake_handler(inbox, wake_token))
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", health)
    return app


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (to clean up) and the bound port (``port`` 0 picks one)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = int(sockets[0].getsockname()[1]) if sockets else port
    return runner, bound
