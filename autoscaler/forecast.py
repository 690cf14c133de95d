"""Short-horizon arrival-rate forecasts: Holt's linear (double exponential) smoothing, and a
seasonal forecast for load that repeats (a period found in the observed load's autocorrelation).

Pure and immutable: ``update`` returns a new ``HoltState``. Samples may come at irregular
intervals (a loop tick is late, a wake ticks early), so the trend is kept per second and the
smoothing is applied per sample, not per fixed period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


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


# --------------------------------------------------------------------------- seasonal (periodic) load
#
# Holt extrapolates a trend; it cannot know that a burst comes back every five minutes. The seasonal
# forecast keeps a bounded history of an observed load measure in fixed bins, looks for a period in
# its autocorrelation, and once one is clear predicts the value ahead as the value one period
# earlier. It learns only from what the policy is given: no period is assumed, and none is found
# until the history holds the pattern once and part of its repeat.


@dataclass(frozen=True)
class SeasonalSettings:
    bin_s: float = 10.0
    """Width of one history bin (the mean of the samples in it)."""
    max_bins: int = 360
    """Memory bound: 360 bins of 10 s = one hour, so periods up to ~40 min can be found."""
    min_period_s: float = 120.0
    """Shorter repeats are left to the stable window (60 s by default), which averages them; pre-scaling
    a cold start ahead of a repeat that short gains little and holds replicas through every lull."""
    min_correlation: float = 0.6
    """Autocorrelation the period's peak must reach to be trusted."""
    min_overlap_fraction: float = 0.5
    """The repeat seen must cover at least this share of one period (a lag L is judged on n - L bins)."""
    min_variation: float = 0.25
    """Coefficient of variation below which the load is flat: no period is looked for."""

    def __post_init__(self) -> None:
        checks = {
            "bin_s": self.bin_s > 0,
            "max_bins": 8 <= self.max_bins <= 100_000,
            "min_period_s": self.min_period_s >= 2 * self.bin_s,
            "min_correlation": 0.0 < self.min_correlation <= 1.0,
            "min_overlap_fraction": 0.0 < self.min_overlap_fraction <= 1.0,
            "min_variation": self.min_variation >= 0.0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid seasonal settings: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


@dataclass(frozen=True)
class SeasonalState:
    """Closed bins (mean value each, oldest first, the last one is bin ``last_bin``), the open bin's
    running sum, and the period found when the last bin closed (None: no period)."""

    last_bin: int
    bins: tuple[float, ...] = ()
    open_bin: int = 0
    open_sum: float = 0.0
    open_count: int = 0
    period_bins: int | None = None
    correlation: float = 0.0

    def period_s(self, settings: SeasonalSettings) -> float | None:
        return None if self.period_bins is None else self.period_bins * settings.bin_s


def find_period(values: tuple[float, ...], settings: SeasonalSettings) -> tuple[int | None, float]:
    """(period in bins, its autocorrelation) or (None, best seen).

    The period is the lag with the highest autocorrelation after the autocorrelation first drops
    below zero (the pattern must end before it can repeat; a trend never repeats, its
    autocorrelation only falls), judged on at least ``min_overlap_fraction`` of a period.
    """
    n = len(values)
    min_lag = max(2, math.ceil(settings.min_period_s / settings.bin_s))
    if n < min_lag + 2:
        return None, 0.0
    mean = sum(values) / n
    if mean <= 0:
        return None, 0.0
    dev = [v - mean for v in values]
    var = sum(d * d for d in dev) / n
    if var <= 0 or math.sqrt(var) / mean < settings.min_variation:
        return None, 0.0
    crossed = False
    best_lag, best_r = None, 0.0
    for lag in range(1, n):
        overlap = n - lag
        if overlap < max(2, settings.min_overlap_fraction * lag):
            break
        # Normalised by the whole history's variance; over a short overlap that can exceed 1: capped.
        r = min(1.0, sum(dev[i] * dev[i + lag] for i in range(overlap)) / overlap / var)
        if r < 0:
            crossed = True
        elif crossed and lag >= min_lag and r > best_r:
            best_lag, best_r = lag, r
    if best_lag is None or best_r < settings.min_correlation:
        return None, best_r
    return best_lag, best_r


def seasonal_update(
    state: SeasonalState | None, value: float, at_s: float, settings: SeasonalSettings
) -> SeasonalState:
    """Fold one sample (any load measure) in; a bin that closes is appended (gaps repeat the last bin) and
    the period is looked for again."""
    index = math.floor(at_s / settings.bin_s)
    if state is None:
        return SeasonalState(last_bin=index - 1, open_bin=index, open_sum=value, open_count=1)
    if index < state.open_bin:
        return state  # a sample from the past (clock skew): ignore
    if index == state.open_bin:
        return replace(state, open_sum=state.open_sum + value, open_count=state.open_count + 1)
    closed = state.open_sum / state.open_count
    # Bins with no sample (metrics were stale) repeat the last value (at most a memory's worth).
    gap = index - state.open_bin - 1
    bins = state.bins + (closed,) * (1 + min(gap, settings.max_bins))
    bins = bins[-settings.max_bins :]
    period, corr = find_period(bins, settings)
    return SeasonalState(
        last_bin=index - 1,
        bins=bins,
        open_bin=index,
        open_sum=value,
        open_count=1,
        period_bins=period,
        correlation=corr,
    )


def seasonal_forecast(
    state: SeasonalState | None, at_s: float, ahead_s: float, span_s: float, settings: SeasonalSettings
) -> float | None:
    """The mean value seen one period before [at + ahead, at + ahead + span), or None (no period)."""
    if state is None or state.period_bins is None or not state.bins:
        return None
    first_bin = state.last_bin - len(state.bins) + 1
    lo = math.floor((at_s + ahead_s) / settings.bin_s) - state.period_bins
    hi = max(lo, math.ceil((at_s + ahead_s + span_s) / settings.bin_s) - 1 - state.period_bins)
    lo, hi = max(lo, first_bin), min(hi, state.last_bin)
    if lo > hi:
        return None
    seen = state.bins[lo - first_bin : hi - first_bin + 1]
    return sum(seen) / len(seen)
