"""Wiring: build the controller and its parts from ``AutoscalerSettings`` and run until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from kvfleet.autoscaler.actuators import KubernetesActuator
from kvfleet.autoscaler.controller import Controller
from kvfleet.autoscaler.deployments import KubernetesDeployments
from kvfleet.autoscaler.leader import LeaseElector
from kvfleet.autoscaler.metrics import AutoscalerMetrics
from kvfleet.autoscaler.prometheus_source import PrometheusSource
from kvfleet.autoscaler.server import build_app, start_server
from kvfleet.autoscaler.settings import AutoscalerSettings
from kvfleet.autoscaler.wake import WakeInbox, WakeToken
from kvfleet.kube import KubeClient
from kvfleet.kube.watch import WatchCollector

log = logging.getLogger(__name__)


async def run_autoscaler(
    settings: AutoscalerSettings,
    stop: asyncio.Event,
    *,
    api: KubeClient | None = None,
    ready: asyncio.Future[int] | None = None,
) -> None:
    """Run until ``stop`` is set. ``ready`` gets the bound HTTP port once serving."""
    inbox = WakeInbox()
    metrics = AutoscalerMetrics()
    elector: LeaseElector | None = None
    background: list[Coroutine[Any, Any, None]] = []  # run until stop, then cancelled
    api = api or KubeClient.from_kubeconfig(settings.kubeconfig, settings.context, user_agent="kvfleet-autoscaler")
    assert settings.prometheus is not None  # the settings validator requires it
    source = PrometheusSource(settings.prometheus)
    watched = KubernetesDeployments(api, settings.namespace)
    metrics.registry.register(WatchCollector("kvfleet_autoscaler_kube_watch", [watched.watch]))
    background.append(watched.run())
    if settings.lease is not None:
        elector = LeaseElector(api, settings.lease, clock=time.time)
    controller = Controller(
        watched,
        source,
        KubernetesActuator(api),
        inbox=inbox,
        metrics=metrics,
        policy=settings.policy,
        settings=settings.loop,
        leadership=elector,
    )
    token = WakeToken(settings.wake_token_file) if settings.wake_token_file else None
    if token is None:
        log.warning("POST /v1/wake takes no token (--wake-token-file unset): anyone who reaches it can wake GPUs")
    elif token is not None:
        token.read()  # fail at start, not at the first wake, when the Secret is missing or empty
    app = build_app(inbox, metrics, token)
    runner, port = await start_server(app, settings.listen_host, settings.listen_port)
    log.info("autoscaler serving wake/metrics on %s:%d", settings.listen_host, port)
    if ready is not None and not ready.done():
        ready.set_result(port)
    tasks = [asyncio.create_task(controller.run(stop), name="autoscaler-loop")]
    if elector is not None:
        tasks.append(asyncio.create_task(elector.run(stop), name="autoscaler-lease"))
    watching = [asyncio.create_task(c, name="autoscaler-watch") for c in background]
    try:
        await asyncio.gather(*tasks)
    finally:
        tasks += watching
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()
        await source.close()
        if api is not None:
            await api.close()
