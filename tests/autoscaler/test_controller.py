"""The control loop with an in-process actuator and a source whose observations the test sets."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from kvfleet.autoscaler.actuators import ActuatorError, ScaleCommand
from kvfleet.autoscaler.controller import Controller
from kvfleet.autoscaler.deployments import Scaled
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.settings import ControllerSettings
from kvfleet.autoscaler.sources import Target
from kvfleet.spec import AutoscalingSpec
from tests.autoscaler.doubles import InProcessActuator, StaticDeployments

CHAT = Target("default", "chat", "tiny-chat", ready_replicas=1)
SPEC = AutoscalingSpec(
    min_replicas=0, max_replicas=8, target_concurrency_per_replica=10, scale_to_zero_after_seconds=60
)


class SetSource:
    """Returns the observation the test last set (sampled now), or a failure."""

    def __init__(self) -> None:
        self.load = 0.0
        self.error: str | None = None
        self.calls = 0

    async def observe(self, target: Target, now_s: float) -> Observation:
        self.calls += 1
        if self.error is not None:
            return Observation.failed(now_s, self.error, ready_replicas=target.ready_replicas)
        return Observation(
            sampled_at_s=now_s,
            ready_replicas=target.ready_replicas,
            engine_concurrency=self.load,
            queue_depth=0.0,
            arrival_rate_rps=0.0,
        )

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.at = 1_000_000.0

    def __call__(self) -> float:
        return self.at


class Leader:
    def __init__(self, leading: bool) -> None:
        self.is_leader = leading


def make(current: int = 1, **kw: object) -> tuple[Controller, SetSource, InProcessActuator, StaticDeployments, Clock]:
    deployments = StaticDeployments([Scaled(CHAT, SPEC, current, current)])
    source = SetSource()
    calls: list[tuple[Target, ScaleCommand]] = []
    actuator = InProcessActuator(
        on_scale=lambda t, c: (calls.append((t, c)), deployments.record_desired(t.key, c.desired_replicas))
    )
    clock = Clock()
    controller = Controller(deployments, source, actuator, clock=clock, **kw)  # type: ignore[arg-type]
    return controller, source, actuator, deployments, clock


async def test_applies_only_changes_and_exports_metrics() -> None:
    controller, source, actuator, _, clock = make()
    source.load = 35  # 35 / 10 -> 4
    [d] = await controller.tick()
    assert (d.desired_replicas, d.reason) == (4, "scale_up")
    command = actuator.commands["default/chat"]
    assert command.desired_replicas == 4 and command.reason.startswith("scale_up: concurrency")
    first_time = command.last_scale_time
    applied = len(actuator.commands)
    for _ in range(3):
        clock.at += 2
        await controller.tick()
    assert actuator.commands["default/chat"] is command  # same count: not written again
    assert applied == 1
    text = controller.metrics.render().decode()
    assert 'kvfleet_autoscaler_desired_replicas{model="tiny-chat",namespace="default"} 4.0' in text
    assert 'kvfleet_autoscaler_max_replicas{model="tiny-chat",namespace="default"} 8.0' in text
    assert 'kvfleet_autoscaler_decisions_total{model="tiny-chat",namespace="default",reason="scale_up"} 1.0' in text
    assert 'kvfleet_autoscaler_decisions_total{model="tiny-chat",namespace="default",reason="steady"} 3.0' in text
    assert 'kvfleet_autoscaler_metrics_stale{model="tiny-chat",namespace="default"} 0.0' in text
    assert first_time.timestamp() == 1_000_000.0


async def test_stale_metrics_hold_log_once_and_export(caplog: pytest.LogCaptureFixture) -> None:
    controller, source, actuator, _, clock = make(current=3)
    source.error = "prometheus unreachable (ConnectionError)"
    with caplog.at_level(logging.INFO, logger="kvfleet.autoscaler.controller"):
        for _ in range(5):
            [d] = await controller.tick()
            assert (d.desired_replicas, d.reason) == (3, "metrics_stale")
            clock.at += 100  # far beyond the scale-to-zero delay: still held
        source.error = None
        await controller.tick()
    stale_logs = [r for r in caplog.records if "metrics stale" in r.getMessage()]
    assert len(stale_logs) == 1  # once per episode
    assert any("metrics fresh again" in r.getMessage() for r in caplog.records)
    written = actuator.commands.get("default/chat")  # at most a refreshed reason, never another count
    assert written is None or written.desired_replicas == 3
    text = controller.metrics.render().decode()
    stale = 'kvfleet_autoscaler_decisions_total{model="tiny-chat",namespace="default",reason="metrics_stale"}'
    assert f"{stale} 5.0" in text


async def test_stale_gauge_is_one_during_the_episode() -> None:
    controller, source, _, _, _ = make()
    source.error = "down"
    await controller.tick()
    rendered = controller.metrics.render().decode()
    assert 'kvfleet_autoscaler_metrics_stale{model="tiny-chat",namespace="default"} 1.0' in rendered


async def test_standby_replica_does_not_act() -> None:
    leader = Leader(False)
    controller, source, actuator, _, _ = make(leadership=leader)
    source.load = 80
    assert await controller.tick() == []
    assert actuator.commands == {} and source.calls == 0
    leader.is_leader = True
    [d] = await controller.tick()
    assert d.desired_replicas == 8


async def test_failed_apply_is_retried_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    controller, source, _, _, clock = make()
    attempts: list[int] = []

    class Flaky:
        fail = True

        async def apply(self, target: Target, command: ScaleCommand) -> None:
            attempts.append(command.desired_replicas)
            if self.fail:
                raise ActuatorError("API server unreachable")

    flaky = Flaky()
    controller.actuator = flaky
    source.load = 25
    with caplog.at_level(logging.WARNING, logger="kvfleet.autoscaler.controller"):
        for _ in range(3):
            await controller.tick()
            clock.at += 2
        flaky.fail = False
        await controller.tick()
        await controller.tick()
    assert attempts == [3, 3, 3, 3]  # retried each tick until it worked, then not again
    assert sum("cannot apply" in r.getMessage() for r in caplog.records) == 1


async def test_wake_decides_at_once_not_at_the_next_tick() -> None:
    # Real time here: a 5 s tick, and a wake must be acted on well before it.
    at_zero = Target("default", "chat", "tiny-chat", ready_replicas=0)
    deployments = StaticDeployments([Scaled(at_zero, SPEC, 0, 0)])
    source = SetSource()
    actuator = InProcessActuator()
    controller = Controller(deployments, source, actuator, settings=ControllerSettings(tick_interval_s=5.0))
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await asyncio.sleep(0.2)  # the first tick has run: at zero, no traffic
        assert "default/chat" not in actuator.commands
        woken_at = time.monotonic()
        assert controller.inbox.request("default", "chat")
        while "default/chat" not in actuator.commands:
            assert time.monotonic() - woken_at < 1.0, "wake not acted on within 1 s"
            await asyncio.sleep(0.01)
        command = actuator.commands["default/chat"]
        assert command.desired_replicas == 1 and command.reason.startswith("wake: router wake signal")
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_wake_for_an_unknown_deployment_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    controller, _, actuator, _, _ = make()
    with caplog.at_level(logging.INFO, logger="kvfleet.autoscaler.controller"):
        assert await controller.tick(wakes={("default", "nope")}, only_woken=True) == []
    assert "wake for default/nope ignored" in caplog.text
    assert actuator.commands == {}


async def test_deleted_deployment_is_forgotten() -> None:
    controller, source, _, deployments, _ = make()
    source.load = 15
    await controller.tick()
    assert 'model="tiny-chat"' in controller.metrics.render().decode()
    deployments.items = []
    await controller.tick()
    text = controller.metrics.render().decode()
    assert 'kvfleet_autoscaler_desired_replicas{model="tiny-chat",namespace="default"}' not in text
    assert 'kvfleet_autoscaler_max_replicas{model="tiny-chat",namespace="default"}' not in text


def test_controller_settings_bounds() -> None:
    with pytest.raises(ValueError, match="tick_interval_s"):
        ControllerSettings(tick_interval_s=0)


def test_the_loop_knows_no_kubernetes_client() -> None:
    # Kubernetes failures are mapped where the Kubernetes parts are (deployments.py, actuators.py)
    # into the autoscaler's own errors; the generic loop imports nothing of kvfleet.kube.
    import ast
    import inspect

    from kvfleet.autoscaler import controller

    tree = ast.parse(inspect.getsource(controller))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.startswith("kvfleet.kube")}, imported
