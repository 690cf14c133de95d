"""What each signal asks for: one function per signal, each returning a ``Proposal`` or None.

A proposal names its signal, the replicas it asks for and why, in numbers. ``strongest`` keeps
the largest (the first in ``SIGNALS`` order on a tie), as Knative's KPA takes the max of its
windows and Ray's scheduler combines what each constraint asks for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvfleet.autoscaler.forecast import holt_forecast, seasonal_forecast
from kvfleet.autoscaler.policy.context import Context
from kvfleet.autoscaler.policy.state import clamp

Signal = Literal["concurrency", "panic", "kv_cache", "gpu_utilization", "ttft", "forecast", "seasonal"]

PER_TARGET: frozenset[Signal] = frozenset({"concurrency", "panic", "forecast", "seasonal"})
"""Signals sized in units of the per-replica target concurrency (their reason says so)."""


@dataclass(frozen=True, slots=True)
class Proposal:
    """The replicas one signal asks for, and its numbers."""

    signal: Signal
    replicas: int
    reason: str


def concurrency(ctx: Context) -> Proposal:
    """ceil(load / target) over the stable window, or over the panic window while panicking."""
    stable_n = math.ceil(ctx.stable_load / ctx.target)
    panic_n = math.ceil(ctx.panic_load / ctx.target)
    if ctx.panicking and panic_n > stable_n:
        return Proposal(
            "panic", panic_n, f"load {ctx.panic_load:.1f} over {ctx.spec.panic_window_seconds:g}s{ctx.load_note}"
        )
    return Proposal(
        "concurrency", stable_n, f"load {ctx.stable_load:.1f} over {ctx.spec.window_seconds:g}s{ctx.load_note}"
    )


def kv_cache(ctx: Context) -> Proposal | None:
    """ceil(ready x KV-cache utilization / its target)."""
    used = ctx.obs.kv_cache_utilization
    if ctx.ready <= 0 or used is None:
        return None
    n = math.ceil(ctx.ready * used / ctx.spec.target_kv_cache_utilization)
    return Proposal("kv_cache", n, f"KV cache {used:.0%} on {ctx.ready} ready")


def gpu_utilization(ctx: Context) -> Proposal | None:
    """ceil(ready x GPU utilization / its target), only when a target is set."""
    used, target = ctx.obs.gpu_utilization, ctx.settings.target_gpu_utilization
    if ctx.ready <= 0 or used is None or target is None:
        return None
    n = math.ceil(ctx.ready * used / target)
    return Proposal("gpu_utilization", n, f"GPU utilization {used:.0%} on {ctx.ready} ready")


def ttft(ctx: Context) -> Proposal | None:
    """ceil(ready x TTFT p90 / SLO), the factor capped, when the breach is one the load cannot see.

    The p90 lags (a window of past requests), so it acts only with every replica ready and no
    scale-up for a stable window + cold start: long enough for the last one to show in a fresh p90.
    A breach while the router held requests, or within the p90's window after, is the backlog's:
    the queue already counts in the load.
    """
    slo_s, p90_s = ctx.spec.ttft_slo_seconds, ctx.obs.ttft_p90_s
    last_up = ctx.prior.last_scale_up_at_s
    quiet = last_up is None or ctx.now - last_up >= ctx.spec.window_seconds + ctx.horizon_s
    if not (ctx.ready >= ctx.current > 0 and quiet and not ctx.backlog_episode):
        return None
    if slo_s is None or p90_s is None or p90_s <= slo_s:
        return None
    n = math.ceil(ctx.ready * min(p90_s / slo_s, ctx.settings.ttft_max_scale_factor))
    return Proposal("ttft", n, f"TTFT p90 {p90_s:.2f}s > SLO {slo_s:g}s on {ctx.ready} ready")


def forecast(ctx: Context) -> Proposal | None:
    """The stable load plus the growth the arrival-rate trend expects within one cold start.

    Only the growth is added, so a flat or falling trend leaves the stable-window proposal alone
    (no scale-up on noise); it is bounded by ``max_forecast_growth_ratio``.
    """
    holt, service_s = ctx.forecast, ctx.service_s
    rate_ahead = holt_forecast(holt, ctx.horizon_s)
    if service_s is None or rate_ahead <= holt.level_rps:
        return None
    growth = (rate_ahead - holt.level_rps) * service_s
    growth = min(growth, (ctx.settings.max_forecast_growth_ratio - 1.0) * max(ctx.stable_load, ctx.target))
    return Proposal(
        "forecast",
        math.ceil((ctx.stable_load + growth) / ctx.target),
        f"arrivals {holt.level_rps:.2f}/s -> {rate_ahead:.2f}/s in {ctx.horizon_s:g}s, "
        f"latency {service_s:.2f}s, load {ctx.stable_load:.1f} + {growth:.1f}",
    )


def seasonal(ctx: Context) -> Proposal | None:
    """Load that repeats: what was in service one period ago, one cold start ahead, asked for now.

    The mean over one stable window starting a cold start ahead, as the concurrency rule would see
    it then: a repeat faster than the window is averaged the same way, not sized for its peaks.
    """
    settings, season, window_s = ctx.settings.seasonal, ctx.seasonal, ctx.spec.window_seconds
    load = seasonal_forecast(season, ctx.now, ctx.horizon_s, window_s, settings)
    if load is None or load <= 0:
        return None
    return Proposal(
        "seasonal",
        math.ceil(load / ctx.target),
        f"period {season.period_s(settings):g}s (autocorrelation {season.correlation:.2f}): load {load:.1f} "
        f"one period before {ctx.horizon_s:g}-{ctx.horizon_s + window_s:g}s ahead",
    )


SIGNALS: tuple[Callable[[Context], Proposal | None], ...] = (
    concurrency,
    kv_cache,
    gpu_utilization,
    ttft,
    forecast,
    seasonal,
)
"""Every signal, in the order ties are broken (the first largest wins)."""


@dataclass(frozen=True, slots=True)
class Ask:
    """The winning proposal, clamped to the bounds, with the reason as status shows it."""

    proposal: Proposal
    clamped: int
    why: str
    """``<signal>: <numbers>`` (and ``/ <target> per replica`` for the load-sized signals)."""

    @property
    def replicas(self) -> int:
        return self.proposal.replicas


def strongest(ctx: Context) -> Ask:
    """The largest proposal of all the signals."""
    proposals = [p for signal in SIGNALS if (p := signal(ctx)) is not None]
    best = max(proposals, key=lambda p: p.replicas)
    target_note = f"/ {ctx.target:g} per replica" if best.signal in PER_TARGET else ""
    return Ask(
        best,
        clamp(best.replicas, ctx.floor, ctx.spec.max_replicas),
        f"{best.signal}: {best.reason} {target_note}".rstrip(),
    )
