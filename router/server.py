"""Build and run the router: ``RouterServer`` (listening) over the fleet, the proxy and the upstream pool.

This is the Python API local mode embeds: a settings object, a ``ReplicaSource`` and a ``WakeSignal``
in; the source feeds the fleet, the proxy serves the OpenAI API on the router's HTTP server
(the ``http_server`` package).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvfleet.router.fleet import Fleet
from kvfleet.router.http_server import HttpServer, HttpServerSettings
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.peer_link import PeerLink, read_key
from kvfleet.router.proxy import Proxy
from kvfleet.router.replicas import ReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.upstream import PoolSettings, UpstreamPool
from kvfleet.router.wake import WakeSignal

log = logging.getLogger(__name__)


class RouterServer:
    """The router listening on ``settings.host:settings.port``; ``port`` is the bound one after ``start``."""

    def __init__(
        self,
        settings: RouterSettings,
        source: ReplicaSource,
        wake: WakeSignal,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or RouterMetrics()
        self.fleet = Fleet(settings, wake, self.metrics, clock=clock)
        self._source = source
        # A keep-alive pool per replica. Bytes pass through as the replica sent them (no decompression), and
        # no cookies are kept: a proxy must never send one client's cookies with another's request.
        self._pool = UpstreamPool(
            PoolSettings(
                max_connections_per_origin=settings.pool_connections_per_replica,
                keepalive_timeout_s=settings.keepalive_timeout_s,
                connect_timeout_s=settings.connect_timeout_s,
                read_timeout_s=settings.idle_read_timeout_s,
                pool_wait_timeout_s=settings.pool_wait_timeout_s,
            )
        )
        proxy = Proxy(settings, self.fleet, self.metrics, self._pool, clock=clock)
        self._http = HttpServer(
            proxy.handle,
            HttpServerSettings(
                max_body_bytes=settings.max_body_bytes,
                keepalive_timeout_s=settings.client_keepalive_timeout_s,
                shutdown_timeout_s=settings.shutdown_timeout_s,
                max_head_bytes=settings.max_request_head_bytes,
                max_headers=settings.max_request_headers,
                head_timeout_s=settings.request_head_timeout_s,
                max_connections=settings.max_client_connections,
                max_connections_per_client=settings.max_client_connections_per_address,
            ),
        )
        self.metrics.track_front_end(lambda: self._http.refusals, lambda: len(self._http.connections))
        # A source with series of its own (the Kubernetes one's watch counters) registers them.
        register = getattr(source, "register_metrics", None)
        if register is not None:
            register(self.metrics.registry)
        self._started = False
        self.port = settings.port
        self.peer_link: PeerLink | None = None  # the other routers' load (peer_link.py), where configured
        if settings.peer_load_port is not None and settings.peer_load_key_file:
            self.peer_link = link = PeerLink(self.fleet, settings, read_key(settings.peer_load_key_file), clock=clock)
            self.metrics.track_peer_load(lambda: dict(link.received))

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def start(self) -> None:
        await self._source.start(self.fleet)
        try:
            await self._http.start(self.settings.host, self.settings.port)
        except BaseException:
            await self._source.stop()
            raise
        if self.peer_link is not None:
            try:
                await self.peer_link.start()
            except BaseException:
                await self._http.close()
                await self._source.stop()
                raise
        self._started = True
        self.port = self._http.port
        log.info("router listening on %s", self.url)

    async def stop(self) -> None:
        """Stop listening, let in-flight requests finish (up to ``shutdown_timeout_s``), then release everything."""
        if not self._started:
            return
        self._started = False
        try:
            if self.peer_link is not None:
                await self.peer_link.close()
            await self._http.close()
        finally:
            await self._source.stop()
            await self.fleet.close()
            await self._pool.close()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
