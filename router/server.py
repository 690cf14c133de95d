"""Build and run the router: ``create_app`` (an aiohttp Application) and ``RouterServer`` (listening).

This is the Python API local mode embeds: a settings object, a ``ReplicaSource`` and a ``WakeSignal``
in; the source feeds the fleet, the proxy serves the OpenAI API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from kvfleet.router.fleet import Fleet
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.proxy import Proxy
from kvfleet.router.replicas import ReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.upstream import PoolSettings, UpstreamPool
from kvfleet.router.wake import WakeSignal

log = logging.getLogger(__name__)

FLEET_KEY = web.AppKey("kvfleet_router_fleet", Fleet)
METRICS_KEY = web.AppKey("kvfleet_router_metrics", RouterMetrics)


def create_app(
    settings: RouterSettings,
    source: ReplicaSource,
    wake: WakeSignal,
    *,
    clock: Callable[[], float] = time.monotonic,
    metrics: RouterMetrics | None = None,
) -> web.Application:
    """The router as an aiohttp Application; ``app[FLEET_KEY]`` and ``app[METRICS_KEY]`` expose its state."""
    metrics = metrics or RouterMetrics()
    fleet = Fleet(settings, wake, metrics, clock=clock)
    pools: list[UpstreamPool] = []

    def upstream() -> UpstreamPool:
        return pools[0]

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # A keep-alive pool per replica. Bytes pass through as the replica sent them (no decompression), and
        # no cookies are kept: a proxy must never send one client's cookies with another's request.
        pools.append(
            UpstreamPool(
                PoolSettings(
                    max_connections_per_origin=settings.pool_connections_per_replica,
                    keepalive_timeout_s=settings.keepalive_timeout_s,
                    connect_timeout_s=settings.connect_timeout_s,
                    read_timeout_s=settings.idle_read_timeout_s,
                )
            )
        )
        await source.start(fleet)
        try:
            yield
        finally:
            await source.stop()
            await fleet.close()
            await pools[0].close()

    app = web.Application(client_max_size=settings.max_body_bytes)
    app[FLEET_KEY] = fleet
    app[METRICS_KEY] = metrics
    app.cleanup_ctx.append(lifecycle)
    Proxy(settings, fleet, metrics, upstream, clock=clock).add_routes(app)
    return app


class RouterServer:
    """The router listening on ``settings.host:settings.port``; ``port`` is the bound one after ``start``."""

    def __init__(
        self,
        settings: RouterSettings,
        source: ReplicaSource,
        wake: WakeSignal,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.app = create_app(settings, source, wake, clock=clock)
        self._runner: web.AppRunner | None = None
        self.port = settings.port

    @property
    def fleet(self) -> Fleet:
        return self.app[FLEET_KEY]

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream
        # request, so the replica stops generating for nobody.
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            shutdown_timeout=self.settings.shutdown_timeout_s,
            access_log=None,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port, reuse_address=True)
        await site.start()
        sockets = [s for server in [site._server] if server is not None for s in getattr(server, "sockets", [])]
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("router listening on %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
