"""``kvfleet local up``: the router, the autoscaler's control loop and the process actuator in one process.

The router and the autoscaler's ``Controller`` are the same code as in the cluster; only the edges
differ (``control.py``): replicas are child processes (the process actuator), the router learns
them from a static source the actuator drives (``routing.py``), the router's wake signal goes
straight into the controller's wake inbox, and the decision goes to the processes instead of into
``status.desiredReplicas``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import aiohttp
from aiohttp import web

from kvfleet.autoscaler.controller import Controller
from kvfleet.autoscaler.engine_metrics import scrape_engine, total_inflight
from kvfleet.autoscaler.prometheus_source import PrometheusSource
from kvfleet.autoscaler.scrape_source import ScrapeSource, ScrapeSourceSettings
from kvfleet.autoscaler.settings import PrometheusSourceSettings
from kvfleet.autoscaler.wake import WakeInbox
from kvfleet.free_port import pick_free_port
from kvfleet.local.actuator import DeploymentProcesses
from kvfleet.local.control import DeploymentRun, EngineScrape, local_controller
from kvfleet.local.models import LocalModelError, ResolvedModel, engine_launch, resolve_model
from kvfleet.local.processes import ProcessStartError
from kvfleet.local.prometheus import LocalPrometheus, ScrapeTarget, start_prometheus
from kvfleet.local.routing import RouterRegistry, local_router_settings
from kvfleet.local.settings import LocalSettings, for_longest_request
from kvfleet.local.status import DeploymentStatus, LocalStatus, ReplicaStatus, status_app, write_endpoint_file
from kvfleet.manifests import load_deployments
from kvfleet.resource import InferenceDeployment
from kvfleet.router.cold_start import ColdStart
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import InProcessWakeSignal, WakeError

log = logging.getLogger(__name__)


class LocalRunError(RuntimeError):
    """Local mode cannot start as asked (bad manifest, missing model, port taken); says why."""


def load_manifests(files: Iterable[Path]) -> list[InferenceDeployment]:
    """Every InferenceDeployment in ``files``; LocalRunError listing each problem with its field."""
    deployments: list[InferenceDeployment] = []
    problems: list[str] = []
    for path in files:
        result = load_deployments(path)
        for where, found in result.problems:
            problems.extend(f"{path}{where}: {p}" for p in found)
        deployments.extend(result.deployments)
    served: dict[str, str] = {}
    for d in deployments:
        if d.served_name in served:
            problems.append(
                f"{d.name}: spec.model.servedName {d.served_name!r} is also served by {served[d.served_name]}"
            )
        served[d.served_name] = d.name
    if problems:
        raise LocalRunError("invalid manifests:\n  " + "\n  ".join(problems))
    if not deployments:
        raise LocalRunError("no InferenceDeployment found in " + ", ".join(map(str, files)))
    return deployments


class LocalRuntime:
    """Start with ``start()``, stop with ``stop(force)``; ``status()`` is what the view shows."""

    def __init__(
        self,
        deployments: Sequence[InferenceDeployment],
        settings: LocalSettings,
        *,
        cwd: Path | None = None,
        clock: Callable[[], float] = time.time,
        router_settings: RouterSettings | None = None,
    ) -> None:
        self.deployments = list(deployments)
        self.settings = settings
        self.cwd = cwd or Path.cwd()
        self.clock = clock
        self._router_settings_given = router_settings
        self.router_settings = router_settings or RouterSettings(host=settings.host, port=settings.router_port)
        self.source = StaticReplicaSource()
        # Built once the models are resolved: the router loads their tokenizers as it starts.
        self._router: RouterServer | None = None
        self.runs: dict[str, DeploymentRun] = {}
        self.models: dict[str, ResolvedModel] = {}
        self.prometheus: LocalPrometheus | None = None
        self.metric_source: EngineScrape | None = None
        self.metric_source_name = "engines (direct scrape)"
        # The router's wake signal lands here; the controller decides for the woken deployment at once.
        self.inbox = WakeInbox()
        self.controller: Controller | None = None
        self.status_url = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._status_runner: web.AppRunner | None = None
        self._stop_loop = asyncio.Event()
        self._started_s = clock()
        self._stopped = False

    @property
    def router(self) -> RouterServer:
        if self._router is None:
            raise RuntimeError("the router is built by LocalRuntime.start()")
        return self._router

    # -- start ----------------------------------------------------------------------------------
    async def start(self) -> None:
        state_dir = self.settings.state_dir
        self.models = models = await asyncio.to_thread(self._resolve_models)
        grace_s = self.settings.processes.term_grace_s
        launches = {d.name: engine_launch(d, models[d.name].path, grace_s) for d in self.deployments}
        if self._router_settings_given is None:
            self.router_settings = local_router_settings(self.router_settings, self.deployments, launches)
        self._router = RouterServer(self.router_settings, self.source, InProcessWakeSignal(self._wake))
        self._session = aiohttp.ClientSession()
        try:
            for d in self.deployments:
                # The spec's estimate is what a held client is told is left (router/cold_start.py).
                estimate = ColdStart(d.spec.autoscaling.cold_start_seconds) if d.spec.autoscaling else None
                self.source.set_deployment(
                    d.served_name, routing=d.spec.routing, namespace=d.namespace, name=d.name, cold_start=estimate
                )
            try:
                await self.router.start()
            except OSError as e:
                raise LocalRunError(
                    f"router cannot listen on {self.router_settings.host}:{self.router_settings.port}: {e}"
                ) from e
            if self.settings.with_prometheus:
                try:
                    self.prometheus = await start_prometheus(
                        state_dir / "prometheus",
                        f"127.0.0.1:{self.router.port}",
                        self._session,
                        port=self.settings.prometheus_port,
                        scrape_interval_s=self.settings.prometheus_scrape_interval_s,
                        binary=self.settings.prometheus_binary,
                    )
                except ProcessStartError as e:
                    raise LocalRunError(f"prometheus did not start: {e}") from e
            prometheus_url = self.prometheus.url if self.prometheus else self.settings.prometheus_url
            decide_from: ScrapeSource | PrometheusSource
            if prometheus_url is not None:
                # rate() needs at least 4 scrapes in its range (PromQL's own rule of thumb).
                window_s = max(5, round(4 * self.settings.prometheus_scrape_interval_s))
                decide_from = PrometheusSource(PrometheusSourceSettings(url=prometheus_url, rate_window=f"{window_s}s"))
                self.metric_source_name = f"Prometheus {prometheus_url}"
            else:
                decide_from = ScrapeSource(ScrapeSourceSettings(router_url=self.router.url), self._session)
            self.metric_source = EngineScrape(self.runs, self._session, decide_from)
            registry = RouterRegistry(
                self.source,
                {d.name: d.served_name for d in self.deployments},
                self.router.fleet.inflight,
                self._targets_changed,
            )
            for d in self.deployments:
                launch = launches[d.name]
                processes = DeploymentProcesses(
                    name=d.name,
                    command=launch.argv,
                    registry=registry,
                    settings=for_longest_request(self.settings.processes, d.spec.engine.max_request_seconds),
                    session=self._session,
                    log_dir=state_dir / "logs",
                    max_replicas=self._max_replicas(d),
                    engine_inflight=self._engine_inflight,
                    env=launch.process_env(),
                    kv_events=launch.kv_events,
                )
                # Like the operator, start at the floor: the controller scales from there (it leaves a
                # deployment at zero alone until traffic arrives, whatever minReplicas says).
                run = self.runs[d.name] = DeploymentRun(d, processes)
                start_at = self._min_replicas(d)
                why = "the minimum" if run.autoscaled else "autoscaling off: spec.replicas"
                processes.set_desired(start_at, f"initial: {start_at} replica(s) ({why})")
                self._tasks.append(asyncio.create_task(processes.run(), name=f"processes-{d.name}"))
            await self._start_status_server()
            self.controller = local_controller(
                self.runs, self.metric_source, self.inbox, self.settings.tick_s, self.clock
            )
            self._tasks.append(asyncio.create_task(self.controller.run(self._stop_loop), name="autoscaler"))
            if any(not run.autoscaled for run in self.runs.values()):
                self._tasks.append(asyncio.create_task(self._watch_fixed(), name="fixed-replicas-view"))
        except BaseException:
            await self.stop(force=None)
            raise

    def _resolve_models(self) -> dict[str, ResolvedModel]:
        models: dict[str, ResolvedModel] = {}
        for d in self.deployments:
            try:
                models[d.name] = resolve_model(d, self.cwd, self.settings.state_dir)
                engine_launch(d, models[d.name].path)  # refuse unsupported engine settings before starting
            except LocalModelError as e:
                for m in models.values():
                    if m.release is not None:
                        m.release()
                raise LocalRunError(str(e)) from e
        return models

    @staticmethod
    def _min_replicas(d: InferenceDeployment) -> int:
        a = d.spec.autoscaling
        return a.min_replicas if a is not None and a.enabled else d.spec.fixed_replicas()

    @staticmethod
    def _max_replicas(d: InferenceDeployment) -> int:
        a = d.spec.autoscaling
        return a.max_replicas if a is not None and a.enabled else d.spec.fixed_replicas()

    async def _start_status_server(self) -> None:
        runner = web.AppRunner(status_app(self.status), access_log=None)
        await runner.setup()
        port = self.settings.status_port or pick_free_port()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        except OSError as e:
            await runner.cleanup()
            raise LocalRunError(f"status endpoint cannot listen on 127.0.0.1:{port}: {e}") from e
        self._status_runner = runner
        self.status_url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(
            write_endpoint_file, self.settings.state_dir, self.status_url, self.router.url, os.getpid()
        )

    # -- the wake signal, and what the autoscaler does not scale ---------------------------------
    def _wake(self, namespace: str, name: str) -> None:
        if not self.inbox.request(namespace, name):
            raise WakeError(f"too many pending wake-ups (at most {self.inbox.max_pending})")

    async def _watch_fixed(self) -> None:
        """Deployments with autoscaling off run ``spec.replicas`` engines and are not the controller's;
        their engines are scraped once a tick for the view alone."""
        assert self.metric_source is not None
        while True:
            for run in self.runs.values():
                if not run.autoscaled:
                    await self.metric_source.scrape(run, self.clock())
            await asyncio.sleep(self.settings.tick_s)

    async def _engine_inflight(self, url: str) -> int:
        assert self._session is not None
        return total_inflight([await scrape_engine(self._session, url)])

    def _targets_changed(self) -> None:
        if self.prometheus is None:
            return
        # namespace: the deployment's, as the operator's ServiceMonitor gives engines in a cluster; the
        # autoscaler's PromQL selects engines by it with the served name.
        targets = [
            ScrapeTarget(
                r.url.removeprefix("http://"),
                {"namespace": run.deployment.namespace, "deployment": name, "replica": r.replica_id},
            )
            for name, run in self.runs.items()
            for r in run.processes.replicas.values()
            if r.state != "starting"
        ]
        self.prometheus.set_engine_targets(targets)

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> LocalStatus:
        deployments = []
        for name, run in self.runs.items():
            stats = run.window.stats()
            current, scaling = run.decision, run.last_scaling
            ago = f" ({self.clock() - run.last_scaling_at_s:.0f} s ago)" if run.last_scaling_at_s is not None else ""
            deployments.append(
                DeploymentStatus(
                    name=name,
                    served_name=run.deployment.served_name,
                    desired_replicas=run.processes.desired,
                    min_replicas=self._min_replicas(run.deployment),
                    max_replicas=self._max_replicas(run.deployment),
                    replicas=[
                        ReplicaStatus(replica_id=s.replica_id, state=s.state, url=s.url, pid=s.pid, age_s=s.age_s)
                        for s in run.processes.snapshot()
                    ],
                    queue_depth=self.router.fleet.queue_depth(run.deployment.served_name) + stats.queue_depth,
                    running=stats.running,
                    requests_per_s=stats.requests_per_s,
                    ttft_p50_s=stats.ttft_p50_s,
                    ttft_p99_s=stats.ttft_p99_s,
                    prefix_hit_rate=stats.prefix_hit_rate,
                    last_decision=f"{scaling.reason} -> {scaling.desired_replicas}{ago}" if scaling else None,
                    last_decision_reason=scaling.detail if scaling else None,
                    current_decision=f"{current.reason}: {current.detail}" if current else None,
                    events=list(run.processes.events)[-10:],
                )
            )
        return LocalStatus(
            router_url=self.router.url,
            metrics_source=self.metric_source_name,
            prometheus_url=self.prometheus.url if self.prometheus else self.settings.prometheus_url,
            uptime_s=round(self.clock() - self._started_s, 1),
            deployments=deployments,
        )

    # -- stop -----------------------------------------------------------------------------------
    async def stop(self, force: asyncio.Event | None) -> None:
        """Drain every engine (``force`` set: kill them), then stop the router, Prometheus, the endpoint."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_loop.set()
        for task in self._tasks:
            if task.get_name() == "autoscaler":
                task.cancel()
        await asyncio.gather(*(run.processes.shutdown(force) for run in self.runs.values()))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._router is not None:
            await self._router.stop()
        if self.metric_source is not None:
            await self.metric_source.close()
        if self.prometheus is not None:
            await self.prometheus.stop()
        if self._status_runner is not None:
            await self._status_runner.cleanup()
            self._status_runner = None
            (self.settings.state_dir / "endpoint.json").unlink(missing_ok=True)
        if self._session is not None:
            await self._session.close()
        for model in self.models.values():
            if model.release is not None:
                model.release()

    async def rolling_restart(self, reason: str) -> None:
        """Replace every deployment's engines one at a time, draining each old one (no request lost)."""
        await asyncio.gather(*(run.processes.rolling_restart(reason) for run in self.runs.values()))

    def kill_all(self) -> None:
        for run in self.runs.values():
            run.processes.kill_all()
        if self.prometheus is not None:
            self.prometheus.child.kill()
