"""Helpers for local mode's tests: a registry that records what the router would be told, and
the command of a small replica server process (support/replica_server.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPLICA_SERVER = Path(__file__).with_name("replica_server.py")


@dataclass
class RecordingRegistry:
    """The registry side of the actuator as the router sees it: which replicas it may use."""

    active: dict[str, str] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)
    history: list[tuple[str, str]] = field(default_factory=list)
    router_inflight: dict[str, int] = field(default_factory=dict)

    def add(self, deployment: str, replica_id: str, url: str, kv_events_port: int | None = None) -> None:
        self.active[replica_id] = url
        self.history.append(("add", replica_id))

    def mark_draining(self, deployment: str, replica_id: str) -> None:
        self.draining.add(replica_id)
        self.history.append(("draining", replica_id))

    def remove(self, deployment: str, replica_id: str) -> None:
        self.active.pop(replica_id, None)
        self.draining.discard(replica_id)
        self.history.append(("remove", replica_id))

    def inflight(self, deployment: str, replica_id: str) -> int:
        return self.router_inflight.get(replica_id, 0)


def replica_command(*extra: str) -> object:
    def command(port: int, kv_events_port: int | None = None) -> Sequence[str]:
        return [sys.executable, str(REPLICA_SERVER), "--port", str(port), *extra]

    return command
