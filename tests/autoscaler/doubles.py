"""In-process stand-ins for the controller's Kubernetes edges, for the controller's own tests.

The product's edges are ``KubernetesDeployments``/``KubernetesActuator`` (a cluster) and local mode's
``LocalDeployments``/``ProcessActuator``; these two hold a list and record commands in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvfleet.autoscaler.actuators import ScaleCommand
from kvfleet.autoscaler.deployments import Scaled
from kvfleet.autoscaler.sources import Target


class InProcessActuator:
    """Keeps the latest command per deployment and calls back."""

    def __init__(self, on_scale: Callable[[Target, ScaleCommand], None] | None = None) -> None:
        self.on_scale = on_scale
        self.commands: dict[str, ScaleCommand] = {}

    async def apply(self, target: Target, command: ScaleCommand) -> None:
        self.commands[target.key] = command
        if self.on_scale is not None:
            self.on_scale(target, command)


class StaticDeployments:
    """A fixed list of deployments whose count the in-process actuator records."""

    def __init__(self, items: list[Scaled]) -> None:
        self.items = list(items)

    async def list(self) -> list[Scaled]:
        return list(self.items)

    def record_desired(self, key: str, desired: int) -> None:
        """What the in-process actuator applied, as the operator's status would show it."""
        self.items = [
            replace(s, current_replicas=desired, status_desired=desired) if s.target.key == key else s
            for s in self.items
        ]
