"""The metric-source interface: given a deployment, return an ``Observation`` (errors included).

A source never raises for an expected failure (server down, timeout, bad payload): it returns
``Observation.failed`` with the reason, so the policy holds and the loop carries on. Only
``asyncio.CancelledError`` and programming errors propagate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.autoscaler.observation import Observation


@dataclass(frozen=True)
class Target:
    """One autoscaled deployment as the sources need to see it."""

    namespace: str
    name: str
    served_name: str
    ready_replicas: int = 0
    measured_cold_start_s: float | None = None
    engine_urls: tuple[str, ...] = field(default=())
    """Local mode only: base URLs of the engines whose /metrics the scrape source reads."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class SourceError(Exception):
    """A source could not produce an observation; the message says why (no secrets, no bodies)."""


class MetricSource(Protocol):
    async def observe(self, target: Target, now_s: float) -> Observation: ...

    async def close(self) -> None: ...
