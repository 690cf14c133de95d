"""``kvfleet local up``: the router, the autoscaler and the process actuator in one process.

The router and the autoscaler's policy are the same code as in the cluster; only the edges
differ: replicas are child processes (the actuator), the router learns them from a static
source the actuator drives, the router's wake signal is a direct call, and the autoscaler's
decision goes straight to the actuator instead of into ``status.desiredReplicas``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from kvfleet.autoscaler.policy import Decision, PolicyState, decide, initial_state
from kvfleet.autoscaler.prometheus_source import PrometheusSource, PrometheusSourceSettings
from kvfleet.autoscaler.scrape_source import ScrapeSource, ScrapeSourceSettings
from kvfleet.autoscaler.sources import MetricSource, Target
from kvfleet.free_port import pick_free_port
from kvfleet.local.actuator import DeploymentProcesses
from kvfleet.local.metrics import EngineSample, MetricWindow, scrape_engine, total_inflight
from kvfleet.local.models import EngineLaunch, LocalModelError, ResolvedModel, engine_launch, resolve_model
from kvfleet.local.processes import ProcessStartError
from kvfleet.local.prometheus import LocalPrometheus, ScrapeTarget, start_prometheus
from kvfleet.local.settings import LocalSettings, for_longest_request
from kvfleet.local.status import (
    DeploymentStatus,
    LocalStatus,
    ReplicaStatus,
    render_status,
    status_app,
    write_endpoint_file,
)
from kvfleet.manifests import load_deployments
from kvfleet.resource import InferenceDeployment
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import InProcessWakeSignal

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


# The router's kv_events_port turns subscriptions on; every local engine announces its own port with
# kv_events_announced_only, so this value is never dialled.
LOCAL_KV_EVENTS_PORT = 5557


def local_router_settings(
    base: RouterSettings, deployments: Sequence[InferenceDeployment], launches: Mapping[str, EngineLaunch]
) -> RouterSettings:
    """The router subscribes to the engines that publish KV-cache events, tokenizing each such model's
    prompts with its own folder (the tiny model's tokenizer.json and chat template included)."""
    tokenizers = {d.served_name: str(launches[d.name].model_path) for d in deployments if launches[d.name].kv_events}
    if not tokenizers:
        return base
    return base.model_copy(
        update={
            "kv_events_port": LOCAL_KV_EVENTS_PORT,
            "kv_events_announced_only": True,
            "kv_events_tokenizers": tokenizers,
        }
    )


@dataclass
class RouterRegistry:
    """The actuator's view of the router: replicas by deployment name, mapped to served names."""

    source: StaticReplicaSource
    served: dict[str, str]
    inflight_of: Callable[[str], dict[str, int]]
    on_change: Callable[[], None] = lambda: None

    def add(self, deployment: str, replica_id: str, url: str, kv_events_port: int | None = None) -> None:
        self.source.add(self.served[deployment], replica_id, url, kv_events_port=kv_events_port)
        self.on_change()

    def mark_draining(self, deployment: str, replica_id: str) -> None:
        with contextlib.suppress(KeyError):  # already removed (it died meanwhile)
            self.source.mark_draining(self.served[deployment], replica_id)

    def remove(self, deployment: str, replica_id: str) -> None:
        self.source.remove(self.served[deployment], replica_id)
        self.on_change()

    def inflight(self, deployment: str, replica_id: str) -> int:
        return self.inflight_of(self.served[deployment]).get(replica_id, 0)


@dataclass
class DeploymentRun:
    """One deployment's moving parts in local mode."""

    deployment: InferenceDeployment
    processes: DeploymentProcesses
    model: ResolvedModel
    policy: PolicyState
    window: MetricWindow = field(default_factory=MetricWindow)
    decision: Decision | None = None
    # The last decision that changed the replica count, and when (what the view calls "last scaling").
    last_scaling: Decision | None = None
    last_scaling_at_s: float | None = None
    wake_requested: bool = False


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
        self.prometheus: LocalPrometheus | None = None
        self.metric_source: MetricSource | None = None
        self.metric_source_name = "engines (direct scrape)"
        self.status_url = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._status_runner: web.AppRunner | None = None
        self._tick_now = asyncio.Event()
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
        models = await asyncio.to_thread(self._resolve_models)
        launches = {d.name: engine_launch(d, models[d.name].path) for d in self.deployments}
        if self._router_settings_given is None:
            self.router_settings = local_router_settings(self.router_settings, self.deployments, launches)
        self._router = RouterServer(self.router_settings, self.source, InProcessWakeSignal(self._wake))
        self._session = aiohttp.ClientSession()
        try:
            for d in self.deployments:
                self.source.set_deployment(d.served_name, routing=d.spec.routing, namespace=d.namespace, name=d.name)
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
            if prometheus_url is not None:
                # rate() needs at least 4 scrapes in its range (PromQL's own rule of thumb).
                window_s = max(5, round(4 * self.settings.prometheus_scrape_interval_s))
                self.metric_source = PrometheusSource(
                    PrometheusSourceSettings(url=prometheus_url, rate_window=f"{window_s}s")
                )
                self.metric_source_name = f"Prometheus {prometheus_url}"
            else:
                self.metric_source = ScrapeSource(ScrapeSourceSettings(router_url=self.router.url), self._session)
            registry = RouterRegistry(
                self.source,
                {d.name: d.served_name for d in self.deployments},
                self.router.fleet.inflight,
                self._targets_changed,
            )
            now = self.clock()
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
                # Like the operator, start at the floor: the policy scales from there (it leaves a
                # deployment at zero alone until traffic arrives, whatever minReplicas says).
                start_at = self._min_replicas(d)
                processes.set_desired(start_at, f"initial: {start_at} replica(s) (the minimum)")
                self.runs[d.name] = DeploymentRun(d, processes, models[d.name], initial_state(start_at, now))
                self._tasks.append(asyncio.create_task(processes.run(), name=f"processes-{d.name}"))
            await self._start_status_server()
            self._tasks.append(asyncio.create_task(self._scale_loop(), name="autoscaler"))
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

    # -- the wake signal and the decisions ------------------------------------------------------
    def _wake(self, namespace: str, name: str) -> None:
        run = self.runs.get(name)
        if run is None:
            return
        run.wake_requested = True
        self._tick_now.set()  # act within this tick, not the next one

    async def _scale_loop(self) -> None:
        while True:
            self._tick_now.clear()
            for run in list(self.runs.values()):
                await self._decide(run)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tick_now.wait(), self.settings.tick_s)

    async def _decide(self, run: DeploymentRun) -> None:
        d, processes = run.deployment, run.processes
        engines = await self._scrape(processes)
        now = self.clock()
        run.window.observe(now, engines)
        autoscaling = d.spec.autoscaling
        if autoscaling is None or not autoscaling.enabled:
            processes.set_desired(d.spec.fixed_replicas(), "autoscaling off: spec.replicas")
            return
        assert self.metric_source is not None
        ready_urls = tuple(processes.ready_urls())
        target = Target(
            namespace=d.namespace,
            name=d.name,
            served_name=d.served_name,
            ready_replicas=len(ready_urls),
            engine_urls=ready_urls,
        )
        observation = await self.metric_source.observe(target, now)
        if run.wake_requested:
            observation = observation.with_wake()
            run.wake_requested = False
        decision = decide(observation, run.policy, autoscaling, now)
        run.policy = decision.state
        if decision.desired_replicas != processes.desired:
            run.last_scaling, run.last_scaling_at_s = decision, now
        run.decision = decision
        processes.set_desired(decision.desired_replicas, f"{decision.reason}: {decision.detail}")

    async def _scrape(self, processes: DeploymentProcesses) -> dict[str, EngineSample]:
        """Metrics of the replicas that serve (ready or draining); one that does not answer is left out."""
        assert self._session is not None
        replicas = [r for r in processes.replicas.values() if r.state != "starting"]
        results = await asyncio.gather(*(scrape_engine(self._session, r.url) for r in replicas), return_exceptions=True)
        samples: dict[str, EngineSample] = {}
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, EngineSample):
                samples[replica.replica_id] = result
            elif isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # CancelledError and friends are never swallowed
        return samples

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
        for run in self.runs.values():
            if run.model.release is not None:
                run.model.release()

    async def rolling_restart(self, reason: str) -> None:
        """Replace every deployment's engines one at a time, draining each old one (no request lost)."""
        await asyncio.gather(*(run.processes.rolling_restart(reason) for run in self.runs.values()))

    def kill_all(self) -> None:
        for run in self.runs.values():
            run.processes.kill_all()
        if self.prometheus is not None:
            self.prometheus.child.kill()


async def run_until_signalled(
    deployments: Sequence[InferenceDeployment], settings: LocalSettings, *, view: bool
) -> int:
    """Run until SIGINT/SIGTERM; a second one kills the engines instead of draining them."""
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=not view)
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            force.set()
        else:
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    runtime = LocalRuntime(deployments, settings)
    restarts: set[asyncio.Task[None]] = set()

    def on_hangup() -> None:
        # SIGHUP: a rolling restart of the engines (new binaries or weights on disk), as a Deployment rollout.
        task = asyncio.create_task(runtime.rolling_restart("SIGHUP"))
        restarts.add(task)
        task.add_done_callback(restart_done)

    def restart_done(task: asyncio.Task[None]) -> None:
        restarts.discard(task)
        if not task.cancelled() and task.exception() is not None:
            console.print(f"kvfleet local: rolling restart stopped: {task.exception()}")

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        await runtime.start()
        model = deployments[0].served_name
        console.print(f"[bold]kvfleet local[/bold]: serving {', '.join(d.served_name for d in deployments)}")
        console.print(f"  OpenAI API  {runtime.router.url}/v1   status  {runtime.status_url}/status")
        console.print(
            f"  try: curl {runtime.router.url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\'',
            soft_wrap=True,  # one line, so it can be copied and pasted as is
            markup=False,
        )
        console.print("  Ctrl-C drains and stops everything; a second Ctrl-C kills at once.")
        if view:
            with Live(render_status(runtime.status()), console=console, auto_refresh=False) as live:
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), settings.tick_s)
                    live.update(render_status(runtime.status()), refresh=True)
        else:
            await stop.wait()
        console.print("kvfleet local: stopping (draining engines; Ctrl-C again to kill them)")
    finally:
        try:
            await runtime.stop(force)
        finally:
            runtime.kill_all()
            loop.remove_signal_handler(signal.SIGHUP)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    return 0
