"""A short-horizon arrival-rate forecast: Holt's linear (double exponential) smoothing.

Pure and immutable: ``update`` returns a new ``HoltState``. Samples may come at irregular
intervals (a loop tick is late, a wake ticks early), so the trend is kept per second and the
smoothing is applied per sample, not per fixed period.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HoltSettings:
    """Smoothing factors in (0, 1]: 1 follows the last sample exactly, smaller values smooth more."""

    level_alpha: float = 0.3
    trend_beta: float = 0.1

    def __post_init__(self) -> None:
        for name in ("level_alpha", "trend_beta"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")


@dataclass(frozen=True)
class HoltState:
    """Smoothed level (requests/s), trend (requests/s per second) and the time of the last sample."""

    level_rps: float
    trend_rps_per_s: float
    at_s: float


def holt_update(state: HoltState | None, value_rps: float, at_s: float, settings: HoltSettings) -> HoltState:
    """Fold one arrival-rate sample in. The first sample starts a flat forecast."""
    if state is None:
        return HoltState(level_rps=value_rps, trend_rps_per_s=0.0, at_s=at_s)
    dt_s = at_s - state.at_s
    if dt_s <= 0:
        # A sample at the same instant (a wake tick) carries no slope information.
        return state
    predicted = state.level_rps + state.trend_rps_per_s * dt_s
    level = settings.level_alpha * value_rps + (1.0 - settings.level_alpha) * predicted
    slope = (level - state.level_rps) / dt_s
    trend = settings.trend_beta * slope + (1.0 - settings.trend_beta) * state.trend_rps_per_s
    return HoltState(level_rps=level, trend_rps_per_s=trend, at_s=at_s)


def holt_forecast(state: HoltState, horizon_s: float) -> float:
    """Arrival rate expected ``horizon_s`` after the last sample, never negative."""
    return max(0.0, state.level_rps + state.trend_rps_per_s * max(0.0, horizon_s))
