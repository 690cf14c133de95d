"""Local mode's three edges of the autoscaler's control loop, and the loop built from them.

``autoscaler.Controller`` runs in local mode as it does in a cluster; only its edges are local:

- ``LocalDeployments`` lists the autoscaled deployments with their engine processes' counts (what
  the operator's status says in a cluster);
- ``EngineScrape`` observes a deployment by reading each serving engine's ``/metrics`` once per
  tick with the autoscaler's parser, and hands the same samples to the view's window, so the view
  costs no second scrape; the decision comes from those samples plus the router's ``/metrics``
  (the ``ScrapeSource``) or from Prometheus;
- ``ProcessActuator`` hands a decision to the deployment's ``DeploymentProcesses`` (the operator's
  part: starting and draining engine processes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import aiohttp

from kvfleet.autoscaler.actuators import ScaleCommand, TargetGone
from kvfleet.autoscaler.controller import Controller
from kvfleet.autoscaler.deployments import Scaled
from kvfleet.autoscaler.engine_metrics import EngineSample, scrape_engine
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy import Decision
from kvfleet.autoscaler.prometheus_source import PrometheusSource
from kvfleet.autoscaler.scrape_source import ScrapeSource
from kvfleet.autoscaler.settings import ControllerSettings
from kvfleet.autoscaler.sources import SourceError, Target
from kvfleet.autoscaler.wake import WakeInbox
from kvfleet.local.actuator import DeploymentProcesses, Replica
from kvfleet.local.metrics import MetricWindow
from kvfleet.resource import InferenceDeployment

# An engine that does not answer /metrics within this is left out of the tick (and, when it is
# ready, the tick's observation fails: the policy holds).
SCRAPE_TIMEOUT_S = 2.0


@dataclass
class DeploymentRun:
    """One deployment's moving parts in local mode, and what the view shows of its decisions."""

    deployment: InferenceDeployment
    processes: DeploymentProcesses
    window: MetricWindow = field(default_factory=MetricWindow)
    decision: Decision | None = None
    """This tick's decision (None with autoscaling off)."""
    last_scaling: Decision | None = None
    """The last decision that changed the replica count, and when (what the view calls "last scaling")."""
    last_scaling_at_s: float | None = None

    @property
    def autoscaled(self) -> bool:
        a = self.deployment.spec.autoscaling
        return a is not None and a.enabled

    def target(self) -> Target:
        ready = tuple(self.processes.ready_urls())
        d = self.deployment
        return Target(d.namespace, d.name, d.served_name, ready_replicas=len(ready), engine_urls=ready)


class LocalDeployments:
    """The autoscaled deployments, as the controller's ``DeploymentSource``."""

    def __init__(self, runs: Mapping[str, DeploymentRun]) -> None:
        self.runs = runs

    async def list(self) -> list[Scaled]:
        scaled = []
        for run in self.runs.values():
            spec = run.deployment.spec.autoscaling
            if spec is not None and spec.enabled:
                desired = run.processes.desired
                scaled.append(Scaled(run.target(), spec, current_replicas=desired, status_desired=desired))
        return scaled


class EngineScrape:
    """The controller's ``MetricSource`` in local mode: one GET of each serving engine per tick."""

    def __init__(
        self,
        runs: Mapping[str, DeploymentRun],
        session: aiohttp.ClientSession,
        decide_from: ScrapeSource | PrometheusSource,
        timeout_s: float = SCRAPE_TIMEOUT_S,
    ) -> None:
        self.runs = runs
        self.session = session
        self.decide_from = decide_from
        self.timeout_s = timeout_s

    async def scrape(self, run: DeploymentRun, now_s: float) -> dict[str, EngineSample | SourceError]:
        """Every serving (ready or draining) replica's sample, or why there is none; the samples go
        to the view's window."""
        replicas: list[Replica] = [r for r in run.processes.replicas.values() if r.state != "starting"]
        model = run.deployment.served_name
        results = await asyncio.gather(
            *(scrape_engine(self.session, r.url, model, timeout_s=self.timeout_s) for r in replicas),
            return_exceptions=True,
        )
        by_replica: dict[str, EngineSample | SourceError] = {}
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, EngineSample | SourceError):
                by_replica[replica.replica_id] = result
            elif isinstance(result, BaseException):
                raise result  # CancelledError and programming errors are never swallowed
        run.window.observe(now_s, {k: v for k, v in by_replica.items() if isinstance(v, EngineSample)})
        return by_replica

    async def observe(self, target: Target, now_s: float) -> Observation:
        run = self.runs.get(target.name)
        if run is None:
            return Observation.failed(now_s, f"{target.key} is not a local deployment")
        ready = [r for r in run.processes.replicas.values() if r.state == "ready"]
        scraped = await self.scrape(run, now_s)
        # The readiness seen now, not at listing time: a replica may have joined since.
        target = replace(target, ready_replicas=len(ready), engine_urls=tuple(r.url for r in ready))
        if isinstance(self.decide_from, PrometheusSource):
            return await self.decide_from.observe(target, now_s)
        samples: list[EngineSample] = []
        for replica in ready:
            result = scraped.get(replica.replica_id)
            if isinstance(result, SourceError):
                return Observation.failed(now_s, str(result), ready_replicas=len(ready))
            if result is not None:  # None: it left the serving set during the scrape
                samples.append(result)
        return await self.decide_from.observe_engines(target, now_s, samples)

    async def close(self) -> None:
        await self.decide_from.close()


class ProcessActuator:
    """The controller's ``Actuator`` in local mode: the count goes to the deployment's processes."""

    def __init__(self, runs: Mapping[str, DeploymentRun]) -> None:
        self.runs = runs

    async def apply(self, target: Target, command: ScaleCommand) -> None:
        run = self.runs.get(target.name)
        if run is None:
            raise TargetGone(f"{target.key} is not a local deployment")
        run.processes.set_desired(command.desired_replicas, command.reason)


def local_controller(
    runs: Mapping[str, DeploymentRun],
    source: EngineScrape,
    inbox: WakeInbox,
    tick_s: float,
    clock: Callable[[], float] = time.time,
) -> Controller:
    """The autoscaler's controller over local mode's edges; it records each decision on its run."""

    def decided(target: Target, decision: Decision) -> None:
        run = runs.get(target.name)
        if run is None:
            return
        if decision.desired_replicas != run.processes.desired:
            run.last_scaling, run.last_scaling_at_s = decision, clock()
        run.decision = decision

    return Controller(
        LocalDeployments(runs),
        source,
        ProcessActuator(runs),
        inbox=inbox,
        settings=ControllerSettings(tick_interval_s=tick_s),
        clock=clock,
        on_decision=decided,
    )
