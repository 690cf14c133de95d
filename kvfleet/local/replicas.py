"""Which engine replicas to start or drain: a pure decision, with its reason.

Replicas being started count toward the target (a second scale-up tick must not start them
twice); draining ones do not (they are leaving). Scale-down drains not-yet-ready replicas first
(they serve nothing), then the ready ones with the fewest requests in flight, newest first, so
the least work waits on a drain and long-warm prefix caches are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ReplicaState = Literal["starting", "ready", "draining"]


@dataclass(frozen=True)
class ReplicaView:
    """What the decision needs to know about one replica."""

    replica_id: str
    state: ReplicaState
    inflight: int
    started_at_s: float


@dataclass(frozen=True)
class ScalePlan:
    """Start ``start`` replicas and drain ``drain``; ``reason`` says why (empty plan: why nothing)."""

    start: int
    drain: tuple[str, ...]
    reason: str

    @property
    def is_noop(self) -> bool:
        return self.start == 0 and not self.drain


def plan_scale(replicas: Sequence[ReplicaView], desired: int, max_replicas: int) -> ScalePlan:
    """Bring the live (starting + ready) replica count to ``desired``, capped at ``max_replicas``."""
    if desired < 0:
        raise ValueError(f"desired replicas must be >= 0, got {desired}")
    target = min(desired, max_replicas)
    live = [r for r in replicas if r.state != "draining"]
    if len(live) < target:
        return ScalePlan(
            start=target - len(live),
            drain=(),
            reason=f"{len(live)} live replica(s), {target} wanted: start {target - len(live)}",
        )
    if len(live) > target:
        surplus = len(live) - target
        order = sorted(live, key=lambda r: (r.state == "ready", r.inflight, -r.started_at_s))
        victims = tuple(r.replica_id for r in order[:surplus])
        return ScalePlan(
            start=0,
            drain=victims,
            reason=f"{len(live)} live replica(s), {target} wanted: drain " + ", ".join(victims),
        )
    capped = f" (capped from {desired} by maxReplicas)" if desired > target else ""
    return ScalePlan(start=0, drain=(), reason=f"{len(live)} live replica(s) as wanted{capped}")


def restart_backoff_s(consecutive_failures: int, initial_s: float, max_s: float) -> float:
    """Delay before the next start after ``consecutive_failures`` failed starts or deaths."""
    if consecutive_failures <= 0:
        return 0.0
    return float(min(max_s, initial_s * 2 ** min(consecutive_failures - 1, 30)))
