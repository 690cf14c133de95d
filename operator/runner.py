"""Run the operator: wire the settings, the API client, the reconciler and kopf together.

One configuration (``kvfleet.kube.load_config``: in-cluster, else the kubeconfig) gives both the
operator's ``KubeClient`` and kopf's login (``kvfleet.kube.kopf_login``), so they are one identity.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import kopf
from lightkube.config.kubeconfig import SingleConfig

from kvfleet.kube import KubeClient, load_config
from kvfleet.kube.kopf_login import login_handler

from .coldstart import ColdStartProbe
from .handlers import build_registry, configure_kopf
from .pull_progress import PullProgressProbe
from .reconcile import Reconciler
from .settings import OperatorSettings

USER_AGENT = "kvfleet-operator"


def post_kopf_event(obj: dict[str, Any], *, type: str, reason: str, message: str) -> None:
    """Queue an Event through kopf's poster (it retries with backoff and never fails a handler)."""
    kopf.event(cast(kopf.Body, obj), type=type, reason=reason, message=message[:1024])


async def run_operator(
    settings: OperatorSettings,
    *,
    config: SingleConfig | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run until ``stop_flag`` is set (or forever).

    ``config`` names the API server and credentials (tests point it at a local API server);
    without it, the in-cluster service account or else the kubeconfig (``load_config``), loaded
    again each time kopf logs in again. Raises ``KubeError`` when there is neither.
    """

    def load() -> SingleConfig:
        return config if config is not None else load_config()

    client = KubeClient(load(), timeout_s=settings.api_timeout_s, user_agent=USER_AGENT)
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

    kopf.on.login(registry=registry)(login_handler(load))
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
