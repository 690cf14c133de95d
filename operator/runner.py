"""Run the operator: wire the settings, the API client, the reconciler and kopf together."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import kopf

from .coldstart import ColdStartProbe
from .handlers import build_registry, configure_kopf
from .kube import Credentials, KubeClient
from .pull_progress import PullProgressProbe
from .reconcile import Reconciler
from .settings import OperatorSettings


def post_kopf_event(obj: dict[str, Any], *, type: str, reason: str, message: str) -> None:
    """Queue an Event through kopf's poster (it retries with backoff and never fails a handler)."""
    kopf.event(cast(kopf.Body, obj), type=type, reason=reason, message=message[:1024])


async def run_operator(
    settings: OperatorSettings,
    *,
    connection: kopf.ConnectionInfo | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run until ``stop_flag`` is set (or forever).

    ``connection`` skips the login (tests point it at a local API server); otherwise kopf's
    client-library login finds in-cluster credentials or the kubeconfig.
    """
    credentials = Credentials(connection)
    client = KubeClient(credentials, timeout_s=settings.api_timeout_s)
    coldstart = ColdStartProbe(
        port=settings.launcher_port,
        timeout_s=settings.coldstart_timeout_s,
        pods_per_tick=settings.coldstart_pods_per_tick,
    )
    pull_progress = PullProgressProbe(
        port=settings.launcher_port,
        timeout_s=settings.progress_timeout_s,
        pods_per_tick=settings.progress_pods_per_tick,
    )
    reconciler = Reconciler(
        client, settings, post_event=post_kopf_event, coldstart=coldstart, pull_progress=pull_progress
    )
    registry = build_registry(reconciler, settings)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = connection if connection is not None else kopf.login_via_client(**kwargs)
        if info is not None:
            credentials.set(info)
        return info

    kopf_settings = kopf.OperatorSettings()
    configure_kopf(kopf_settings, settings)
    try:
        await kopf.operator(
            registry=registry,
            settings=kopf_settings,
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=settings.peering_name is None,
            peering_name=settings.peering_name,
            priority=settings.priority,
            liveness_endpoint=(
                f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port is not None else None
            ),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        await client.close()
