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

from kvfleet.kube import KubeClient, KubeError, Ref, load_config
from kvfleet.kube.kopf_login import login_handler

from .child_cache import ChildCache
from .coldstart import ColdStartProbe
from .handlers import OutsideKopf, build_registry, configure_kopf
from .periodic import LookSettings, PeriodicLooks
from .pull_progress import PullProgressProbe
from .reconcile import Reconciler
from .render import CHILD_KINDS, DEPLOYMENT, SERVICE_MONITOR
from .rollout_nudge import NudgeSettings, RolloutNudges
from .served import wait_until_served
from .settings import OperatorSettings

USER_AGENT = "kvfleet-operator"
# What the reconciler reads of its children and pods, watched instead of read by GET (child_cache.py).
# ServiceMonitors too where their CRD is served at start (a watch of a resource the server does not
# serve would fail forever); a CRD installed later is read by GET until the operator restarts.
CACHED_KINDS = (
    *(Ref(kind.api_version, kind.plural) for kind in CHILD_KINDS if kind is not SERVICE_MONITOR),
    Ref("v1", "pods"),
)


async def cached_kinds(client: KubeClient) -> tuple[Ref, ...]:
    monitors = Ref(SERVICE_MONITOR.api_version, SERVICE_MONITOR.plural)
    try:
        served = await client.serves(monitors.api_version, monitors.plural)
    except KubeError:
        served = False  # reads of ServiceMonitors stay GETs
    return (*CACHED_KINDS, monitors) if served else CACHED_KINDS


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
    try:
        # The CRD may have been created a moment ago: wait until it is served (operator/served.py).
        await wait_until_served(client, settings.namespaces)
    except BaseException:
        await client.close()
        raise
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
    # Engine Deployment changes seen by the children's watch reconcile their owner (rollout_nudge.py).
    nudges = (
        RolloutNudges(
            NudgeSettings(coalesce_s=settings.rollout_nudge_coalesce_s, workers=settings.rollout_nudge_workers)
        )
        if settings.cache_children and settings.watch_rollouts
        else None
    )
    cache = (
        ChildCache(
            client,
            await cached_kinds(client),
            namespaces=settings.namespaces,
            listeners={Ref(DEPLOYMENT.api_version, DEPLOYMENT.plural): nudges.seen} if nudges is not None else None,
        )
        if settings.cache_children
        else None
    )
    reconciler = Reconciler(
        client, settings, post_event=post_kopf_event, coldstart=coldstart, pull_progress=pull_progress, cache=cache
    )
    outside = OutsideKopf(reconciler)
    registry = build_registry(reconciler, settings, outside)
    looks = PeriodicLooks(
        LookSettings(
            resync_interval_s=settings.resync_interval_s,
            rollout_check_interval_s=settings.rollout_check_interval_s,
            retry_delay_s=settings.retry_delay_s,
        ),
        bodies=outside.bodies,
        reconcile=lambda namespace, name: outside.reconcile(namespace, name, wait=False),
        last_reconciled=reconciler.last_reconciled,
        free_slots=reconciler.free_slots,
    )

    kopf.on.login(registry=registry)(login_handler(load))
    kopf_settings = kopf.OperatorSettings()
    configure_kopf(kopf_settings, settings)
    if cache is not None:
        cache.start()  # reads fall back to the API server until each watch has listed
    nudging = asyncio.create_task(nudges.run(outside.reconcile), name="rollout nudges") if nudges is not None else None
    looking = asyncio.create_task(looks.run(), name="periodic looks")
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
        background = [task for task in (nudging, looking) if task is not None]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if cache is not None:
            await cache.stop()
        await client.close()
