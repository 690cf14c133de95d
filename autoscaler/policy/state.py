"""What the policy remembers between ticks (``PolicyState``) and what it answers (``Decision``).

Both are frozen: ``decide`` returns the next state inside its decision, and the loop keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from kvfleet.autoscaler.forecast import HoltState, SeasonalState
from kvfleet.autoscaler.service_time import ServiceTimeFit

Reason = Literal[
    "steady",
    "scale_up",
    "panic_scale_up",
    "forecast_scale_up",
    "stabilizing",
    "panic_hold",
    "scale_down",
    "scale_to_zero",
    "wake",
    "metrics_stale",
    "clamped",
]
REASONS: tuple[Reason, ...] = get_args(Reason)


@dataclass(frozen=True)
class PolicyState:
    """Everything the policy remembers between ticks; ``decide`` returns the next one."""

    desired_replicas: int
    started_at_s: float
    last_traffic_at_s: float
    samples: tuple[tuple[float, float], ...] = ()
    """(time, load) within the stable window."""
    proposals: tuple[tuple[float, int], ...] = ()
    """(time, clamped proposal) within the scale-down delay."""
    last_scale_down_at_s: float | None = None
    panic_until_s: float | None = None
    forecast: HoltState | None = None
    latency_s: float | None = None
    stale_since_s: float | None = None
    """Start of the current stale episode (None while metrics are fresh)."""
    last_scale_up_at_s: float | None = None
    """When the count last went up (for any reason)."""
    seasonal: SeasonalState | None = None
    service_samples: tuple[tuple[float, float, int, float], ...] = ()
    """(time, in-service load, ready replicas, router queue) within the stable window: Little's law
    over the window, and the queue's growth while saturated."""
    service_fit: ServiceTimeFit | None = None
    """Service time against concurrency per replica (``service_time.py``)."""
    last_queue_at_s: float | None = None
    """When the router last held requests."""


def initial_state(current_replicas: int, now_s: float) -> PolicyState:
    """State for a deployment seen for the first time (or after an autoscaler restart).

    Starting with no history means no scale-down for one ``scaleDownDelaySeconds`` and no scale to
    zero for one ``scaleToZeroAfterSeconds``: a restart never removes replicas it knows nothing about.
    """
    return PolicyState(desired_replicas=max(0, current_replicas), started_at_s=now_s, last_traffic_at_s=now_s)


@dataclass(frozen=True)
class Decision:
    """The count one deployment should have now, the rule that set it, its numbers, and the next state."""

    desired_replicas: int
    reason: Reason
    detail: str
    state: PolicyState


def clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


T = TypeVar("T")


def append_bounded(items: tuple[T, ...], item: T, limit: int) -> tuple[T, ...]:
    """``items`` with ``item`` appended, keeping at most the last ``limit``."""
    out = (*items, item)
    return out[-limit:] if len(out) > limit else out
