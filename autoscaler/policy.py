"""The scaling policy: ``decide(observation, state, spec, now) -> Decision``. Pure: no I/O, no clock.

Rules, in the order they apply (every decision names the rule in ``reason`` and the numbers in
``detail``):

1. **Fail safe.** A source error, a sample older than ``max_metrics_age_s``, missing concurrency
   while replicas are ready, or a non-finite value: hold the current count (``metrics_stale``).
   Never scale to zero on absent data; the idle clock restarts, since idleness was not observed.
   A router wake still wakes a deployment at zero (the wake is itself evidence of demand).
2. **Signals.** load = max(engine running + waiting, router in-flight) + the router queue, except
   in a backlog episode (the router held requests within the last stable window) once the service
   time S is known. Then the engines are saturated: a full engine holds its batch limit (256 in
   vLLM), far above the target, and every replica that turns ready takes a batch from the queue,
   so the in-service count grows with each replica started and would keep asking for more (13
   replicas for a burst 4-6 serve). In-service concurrency is not demand there, so
   load = max(min(in-service, ready x target), arrivals x S) + queue x S / coldStartSeconds:
   the busy engines only as a lower bound (none is spare), demand by Little's law, and the backlog
   drained within one cold start (what a replica asked for now can do). The arrival rate there is
   max(windowed rate, queue growth + ready x target / S): the windowed rate lags an onset by up
   to a window, the queue's growth plus what the ready replicas serve does not. S is the service
   time at the target concurrency: Little's law (mean in-service / rate over the stable window,
   learnt only with no queue in it) at each load seen, fitted linearly against the concurrency
   per replica (``service_time.py``: a batch's step costs a fixed weight read plus a part per
   sequence) and read at the target; the mean S until the load seen spreads enough to fit.
   Each signal proposes ceil(load / per-replica target): concurrency over the stable window
   (Knative's 60 s), or over the panic window (6 s) while panicking; KV-cache and (when a target
   is set) GPU utilization as ceil(ready x utilization / target); TTFT p90 above the SLO as
   ceil(ready x p90 / SLO) (capped; with all replicas ready, at most once per window + cold
   start, since p90 lags, and not within a window of a backlog, whose waits the p90 still holds
   and the load already counts); a Holt forecast of the arrival rate ``coldStartSeconds`` ahead
   (the measured cold start when known), whose expected growth, times S, is added to the stable
   load; and, once the demand shows a period (autocorrelation, ``forecast.find_period``), the
   mean demand one period ago over the stable window starting a cold start ahead (seasonal).
   The proposal is the max.
3. **Panic.** When the panic-window proposal reaches ``panic_threshold_ratio`` x the current count,
   panic for one stable window: use the panic proposal and never scale down.
4. **Scale to zero** after ``scaleToZeroAfterSeconds`` with no traffic at all (minReplicas 0);
   **wake** from zero at once on any traffic or a router wake signal.
5. **Up at once, down slowly.** A larger proposal applies immediately. A smaller one applies only
   when the max of the proposals over the last ``scaleDownDelaySeconds`` is smaller (so one low
   sample never removes a replica and an up-down-up pattern never flaps), at most one step per
   ``scale_down_step_interval_s``, removing at most ``scale_down_max_fraction`` of the replicas.
6. **Clamp** to [minReplicas, maxReplicas] (at least 1 unless scaling to zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar, get_args

from kvfleet.autoscaler.forecast import (
    HoltSettings,
    HoltState,
    SeasonalSettings,
    SeasonalState,
    holt_forecast,
    holt_update,
    seasonal_forecast,
    seasonal_update,
)
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.service_time import ServiceTimeFit, ServiceTimeSettings, fit_update, service_time_at
from kvfleet.spec import AutoscalingSpec

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
class PolicySettings:
    """Knobs shared by every deployment (per-deployment ones live in the spec's autoscaling)."""

    panic_threshold_ratio: float = 2.0
    """Knative's default: panic when the 6 s proposal is 200% of the current count."""
    max_metrics_age_s: float = 30.0
    """Older samples are stale (two Prometheus scrapes at the usual 15 s interval)."""
    scale_down_max_fraction: float = 0.25
    """Remove at most this share of replicas per step (>= 1 always). A replica's concurrency grows
    faster than its arrival rate near saturation, so a big cut looks safe and is not: small steps,
    each observed before the next."""
    scale_down_step_interval_s: float = 30.0
    """Least time between two scale-down steps, so each step's effect is seen before the next."""
    target_gpu_utilization: float | None = None
    """Off by default: DCGM_FI_DEV_GPU_UTIL is the share of time any kernel ran, so it reads ~100%
    as soon as one request is in flight and would add a replica on every tick. Set a target only
    for a GPU metric that tracks load (e.g. SM activity)."""
    ttft_max_scale_factor: float = 2.0
    """A TTFT breach at most doubles the replicas in one decision."""
    forecast: HoltSettings = field(default_factory=HoltSettings)
    latency_alpha: float = 0.2
    """Smoothing of the Little's-law latency estimate used to turn a forecast rate into concurrency."""
    service_time: ServiceTimeSettings = field(default_factory=ServiceTimeSettings)
    seasonal: SeasonalSettings = field(default_factory=SeasonalSettings)
    max_forecast_growth_ratio: float = 4.0
    """A forecast adds at most (ratio - 1) x the stable load (or one replica's target) to it."""
    max_history_samples: int = 4096
    """Bound on the samples and proposals kept in state (a 1 s tick over a 1 h window)."""

    def __post_init__(self) -> None:
        checks = {
            "panic_threshold_ratio": self.panic_threshold_ratio > 1.0,
            "max_metrics_age_s": self.max_metrics_age_s > 0,
            "scale_down_max_fraction": 0.0 < self.scale_down_max_fraction <= 1.0,
            "scale_down_step_interval_s": self.scale_down_step_interval_s >= 0,
            "target_gpu_utilization": self.target_gpu_utilization is None or 0 < self.target_gpu_utilization <= 1,
            "ttft_max_scale_factor": self.ttft_max_scale_factor > 1.0,
            "latency_alpha": 0.0 < self.latency_alpha <= 1.0,
            "max_forecast_growth_ratio": self.max_forecast_growth_ratio >= 1.0,
            "max_history_samples": 1 <= self.max_history_samples <= 1_000_000,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid policy settings: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


DEFAULT_POLICY = PolicySettings()


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
    desired_replicas: int
    reason: Reason
    detail: str
    state: PolicyState

    @property
    def stale(self) -> bool:
        return self.reason == "metrics_stale"


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


T = TypeVar("T")


def _append_bounded(items: tuple[T, ...], item: T, limit: int) -> tuple[T, ...]:
    out = (*items, item)
    return out[-limit:] if len(out) > limit else out


def _stale_problem(obs: Observation, current: int, now_s: float, settings: PolicySettings) -> str | None:
    """Why this observation cannot be trusted, or None."""
    if obs.error is not None:
        return f"metric source failed: {obs.error}"
    age_s = now_s - obs.sampled_at_s
    if age_s > settings.max_metrics_age_s:
        return f"newest sample is {age_s:.0f}s old (limit {settings.max_metrics_age_s:g}s)"
    values = {
        "engine_concurrency": obs.engine_concurrency,
        "router_in_flight": obs.router_in_flight,
        "queue_depth": obs.queue_depth,
        "arrival_rate_rps": obs.arrival_rate_rps,
        "kv_cache_utilization": obs.kv_cache_utilization,
        "gpu_utilization": obs.gpu_utilization,
        "ttft_p90_s": obs.ttft_p90_s,
    }
    for name, value in values.items():
        if value is not None and (not math.isfinite(value) or value < 0):
            return f"{name} is {value!r}"
    for name in ("kv_cache_utilization", "gpu_utilization"):
        value = values[name]
        if value is not None and value > 1:
            # A fraction is expected; a percent-scaled exporter would otherwise mean max replicas at once.
            return f"{name} is {value!r}, outside [0, 1] (a percent-scaled metric?)"
    if obs.ready_replicas > 0 and obs.engine_concurrency is None and obs.router_in_flight is None:
        return f"no concurrency metrics while {obs.ready_replicas} replicas are ready"
    if current > 0 and obs.ready_replicas == 0 and obs.queue_depth is None and obs.arrival_rate_rps is None:
        # Replicas are starting and no one reports load. (At zero, a router that has not seen the
        # model yet has no series for it; that is "no traffic", and a wake signal still wakes.)
        return "no router metrics (queue depth, arrival rate) while replicas start"
    return None


def _mean_since(samples: tuple[tuple[float, float], ...], since_s: float) -> float:
    values = [load for at_s, load in samples if at_s > since_s]
    return sum(values) / len(values) if values else 0.0


def decide(
    observation: Observation,
    state: PolicyState,
    spec: AutoscalingSpec,
    now: float,
    settings: PolicySettings = DEFAULT_POLICY,
) -> Decision:
    """The replica count one deployment should have now, with the reason and the next state."""
    obs = observation
    current = state.desired_replicas
    limit = settings.max_history_samples
    floor = max(spec.min_replicas, 1)

    problem = _stale_problem(obs, current, now, settings)
    if problem is not None:
        held = _clamp(current, spec.min_replicas, spec.max_replicas)
        reason: Reason = "metrics_stale"
        detail = f"holding {held}: {problem}"
        if held == 0 and obs.wake_requested:
            held, reason, detail = floor, "wake", f"router wake signal at zero replicas (metrics stale: {problem})"
        stale_state = replace(
            state,
            desired_replicas=held,
            last_traffic_at_s=now,
            proposals=_append_bounded(state.proposals, (now, held), limit),
            stale_since_s=state.stale_since_s if state.stale_since_s is not None else now,
        )
        return Decision(held, reason, detail, stale_state)

    # Fresh data from here on.
    in_service = max(obs.engine_concurrency or 0.0, obs.router_in_flight or 0.0)
    queue = obs.queue_depth or 0.0
    rate = obs.arrival_rate_rps or 0.0
    horizon_s = obs.measured_cold_start_s if obs.measured_cold_start_s is not None else spec.cold_start_seconds
    ready = obs.ready_replicas
    target = spec.target_concurrency_per_replica
    latency_s = state.latency_s
    last_queue = now if queue > 0 else state.last_queue_at_s
    # The router held requests within the last stable window: the engines are (or just were) saturated.
    backlog_episode = last_queue is not None and now - last_queue < spec.window_seconds
    service_samples = tuple(
        x
        for x in _append_bounded(state.service_samples, (now, in_service, ready, queue), limit)
        if x[0] > now - spec.window_seconds
    )
    service_fit = state.service_fit
    if rate > 0 and not backlog_episode:
        # Service time by Little's law over the window the arrival rate is measured over (its mean
        # in-service load / its rate: a windowed rate against an instant count is biased on every
        # change of load), learnt only with no queue in that window (a backlog would inflate it).
        mean_in_service = sum(x[1] for x in service_samples) / len(service_samples)
        per_replica = [x[1] / x[2] for x in service_samples if x[2] > 0]
        if mean_in_service > 0 and per_replica:
            little_s = mean_in_service / rate
            latency_s = little_s if latency_s is None else latency_s + settings.latency_alpha * (little_s - latency_s)
            c_mean = sum(per_replica) / len(per_replica)
            service_fit = fit_update(service_fit, c_mean, little_s, now, settings.service_time)
    # The service time where the replicas will run, at the target concurrency (the mean learnt one
    # until the load seen spreads enough to fit how it grows with the batch).
    fitted_s = service_time_at(service_fit, target, settings.service_time)
    service_s = fitted_s if fitted_s is not None else latency_s
    if backlog_episode and service_s is not None:
        # Requests queue at the router: every ready engine is full, and a full engine holds up to its
        # batch limit (256 in vLLM), far above the target. That count is not demand: each replica
        # that turns ready takes a batch from the queue, so counting it would ask for more replicas
        # with every one that starts. Demand is the arrival rate x the service time (Little's law),
        # plus the backlog drained within one cold start (queue x S / cold start: what a replica
        # asked for now can help with); the busy engines count only as a lower bound (ready x target:
        # none of them is spare).
        busy = min(in_service, ready * target)
        # The windowed rate lags an onset by up to a window. The queue does not: it grows by what
        # arrives beyond what the ready replicas serve (at least ready x target / S each), so that
        # sum is a lower bound on the arrival rate now.
        recent = [x for x in service_samples if x[0] >= now - spec.panic_window_seconds]
        first = recent[0] if recent else (now, in_service, ready, queue)
        growth_rps = (queue - first[3]) / (now - first[0]) if now > first[0] else 0.0
        arriving = max(rate, growth_rps + ready * target / service_s if growth_rps > 0 else 0.0)
        drain = queue * service_s / max(horizon_s, 1.0)
        demand = max(busy, arriving * service_s)
        load = demand + drain
        load_note = (
            f" (saturated: max(busy {busy:.0f}, arrivals {arriving:.2f}/s x {service_s:.2f}s) + "
            f"{queue:.0f} queued x {service_s:.2f}s / {horizon_s:g}s)"
        )
    else:
        # No queue, or the service time is not known yet (a queued request then counts in full).
        load = in_service + queue
        demand = in_service
        load_note = ""
    samples = tuple(s for s in _append_bounded(state.samples, (now, load), limit) if s[0] > now - spec.window_seconds)
    stable_load = _mean_since(samples, now - spec.window_seconds)
    panic_load = _mean_since(samples, now - spec.panic_window_seconds)
    traffic = load > 0 or rate > 0 or obs.wake_requested
    # Idleness counts only over fresh observations: the first fresh tick after a stale episode
    # restarts the idle clock, whenever the last stale tick was.
    last_traffic = now if traffic or state.stale_since_s is not None else state.last_traffic_at_s

    # The seasonal history is of the demand (the in-service load, or in a backlog episode the
    # saturated estimate without the drain): in the target's units, and mostly without the lag of
    # the windowed arrival rate, so a repeat is asked for a cold start ahead of when it came last
    # time. The backlog is left out: it says how late capacity came, not how much the repeat needs.
    forecast = holt_update(state.forecast, rate, now, settings.forecast)
    seasonal = seasonal_update(state.seasonal, demand, now, settings.seasonal)

    stable_n = math.ceil(stable_load / target)
    panic_n = math.ceil(panic_load / target)
    panic_until = state.panic_until_s
    if current > 0 and panic_n >= settings.panic_threshold_ratio * current:
        panic_until = now + spec.window_seconds
    panicking = panic_until is not None and now < panic_until
    if not panicking:
        panic_until = None

    proposals: dict[str, tuple[int, str]] = {}
    if panicking and panic_n > stable_n:
        proposals["panic"] = (panic_n, f"load {panic_load:.1f} over {spec.panic_window_seconds:g}s{load_note}")
    else:
        proposals["concurrency"] = (stable_n, f"load {stable_load:.1f} over {spec.window_seconds:g}s{load_note}")
    if ready > 0 and obs.kv_cache_utilization is not None:
        n = math.ceil(ready * obs.kv_cache_utilization / spec.target_kv_cache_utilization)
        proposals["kv_cache"] = (n, f"KV cache {obs.kv_cache_utilization:.0%} on {ready} ready")
    gpu_target = settings.target_gpu_utilization
    if ready > 0 and obs.gpu_utilization is not None and gpu_target is not None:
        n = math.ceil(ready * obs.gpu_utilization / gpu_target)
        proposals["gpu_utilization"] = (n, f"GPU utilization {obs.gpu_utilization:.0%} on {ready} ready")
    slo_s = spec.ttft_slo_seconds
    # TTFT p90 lags (a window of past requests), so it acts only with every replica ready and no
    # scale-up for a stable window + cold start: long enough for the last one to show in a fresh p90.
    last_up = state.last_scale_up_at_s
    ttft_quiet = last_up is None or now - last_up >= spec.window_seconds + horizon_s
    # A breach while the router held requests, or within the p90's window after, is the backlog's:
    # the queue already counts in the load. TTFT is for breaches the concurrency cannot see.
    ttft_quiet = ttft_quiet and not backlog_episode
    if ready >= current > 0 and ttft_quiet and slo_s is not None and (obs.ttft_p90_s or 0.0) > slo_s:
        assert obs.ttft_p90_s is not None
        n = math.ceil(ready * min(obs.ttft_p90_s / slo_s, settings.ttft_max_scale_factor))
        proposals["ttft"] = (n, f"TTFT p90 {obs.ttft_p90_s:.2f}s > SLO {slo_s:g}s on {ready} ready")
    rate_ahead = holt_forecast(forecast, horizon_s)
    if service_s is not None and rate_ahead > forecast.level_rps:
        # Only the growth expected before a new replica could be ready is added to today's load, so
        # a flat or falling trend leaves the stable-window proposal alone (no scale-up on noise).
        growth = (rate_ahead - forecast.level_rps) * service_s
        growth = min(growth, (settings.max_forecast_growth_ratio - 1.0) * max(stable_load, target))
        proposals["forecast"] = (
            math.ceil((stable_load + growth) / target),
            f"arrivals {forecast.level_rps:.2f}/s -> {rate_ahead:.2f}/s in {horizon_s:g}s, "
            f"latency {service_s:.2f}s, load {stable_load:.1f} + {growth:.1f}",
        )
    # The mean over one stable window starting a cold start ahead, as the concurrency rule would see
    # it then: a repeat faster than the window is averaged the same way, not sized for its peaks.
    load_season = seasonal_forecast(seasonal, now, horizon_s, spec.window_seconds, settings.seasonal)
    if load_season is not None and load_season > 0:
        # Load that repeats: what was in service one period ago, one cold start ahead, is asked for now.
        period_s = seasonal.period_s(settings.seasonal)
        proposals["seasonal"] = (
            math.ceil(load_season / target),
            f"period {period_s:g}s (autocorrelation {seasonal.correlation:.2f}): load {load_season:.1f} "
            f"one period before {horizon_s:g}-{horizon_s + spec.window_seconds:g}s ahead",
        )
    signal, (proposal, why) = max(proposals.items(), key=lambda item: item[1][0])
    target_note = f"/ {target:g} per replica" if signal in ("concurrency", "panic", "forecast", "seasonal") else ""
    why = f"{signal}: {why} {target_note}".rstrip()

    next_state = replace(
        state,
        samples=samples,
        last_traffic_at_s=last_traffic,
        forecast=forecast,
        latency_s=latency_s,
        seasonal=seasonal,
        service_samples=service_samples,
        service_fit=service_fit,
        last_queue_at_s=last_queue,
        panic_until_s=panic_until,
        stale_since_s=None,
    )

    clamped = _clamp(proposal, floor, spec.max_replicas)

    def done(desired: int, reason: Reason, detail: str, recorded: int, scaled_down: bool = False) -> Decision:
        kept = tuple(p for p in state.proposals if p[0] > now - spec.scale_down_delay_seconds)
        final = replace(
            next_state,
            last_scale_up_at_s=now if desired > current else state.last_scale_up_at_s,
            desired_replicas=desired,
            proposals=_append_bounded(kept, (now, recorded), limit),
            last_scale_down_at_s=now if scaled_down else state.last_scale_down_at_s,
        )
        return Decision(desired, reason, detail, final)

    # Scale to zero and wake.
    zero_after_s = spec.effective_scale_to_zero_after_s
    if zero_after_s is not None and not traffic and now - last_traffic >= zero_after_s:
        idle = f"no traffic for {now - last_traffic:.0f}s (scale to zero after {zero_after_s:g}s)"
        return done(0, "scale_to_zero" if current > 0 else "steady", idle, recorded=0)
    if current == 0:
        if not traffic and spec.min_replicas > 0:
            # A deployment created (or left) at zero with minReplicas > 0 is brought up to its
            # floor without waiting for traffic: minReplicas is a promise of warm capacity.
            floor_note = f"0 is below minReplicas {spec.min_replicas}"
            return done(spec.min_replicas, "clamped", floor_note, recorded=spec.min_replicas)
        if not traffic:
            return done(0, "steady", "at zero, no traffic", recorded=0)
        woken = _clamp(max(proposal, floor), floor, spec.max_replicas)
        cause = "router wake signal" if obs.wake_requested else f"traffic at zero replicas (load {load:.1f})"
        return done(woken, "wake", f"{cause}; {why}", recorded=woken)

    if current > spec.max_replicas:
        return done(spec.max_replicas, "clamped", f"{current} is above maxReplicas {spec.max_replicas}", clamped)
    if clamped > current:
        if proposal < floor:
            return done(clamped, "clamped", f"{current} is below the floor {floor}", clamped)
        reason = (
            "panic_scale_up"
            if signal == "panic"
            else "forecast_scale_up"
            if signal in ("forecast", "seasonal")
            else "scale_up"
        )
        capped = f" (capped at maxReplicas {spec.max_replicas})" if proposal > spec.max_replicas else ""
        return done(clamped, reason, f"{why} -> {proposal}{capped}", clamped)
    if clamped == current:
        return done(current, "steady", f"{why} -> {proposal}", clamped)

    # clamped < current: scale down only when every proposal over the delay agrees.
    if panicking:
        return done(current, "panic_hold", f"panicking until {panic_until:.0f}; {why} -> {proposal}", clamped)
    delay_s = spec.scale_down_delay_seconds
    if now - state.started_at_s < delay_s:
        return done(current, "stabilizing", f"history {now - state.started_at_s:.0f}s < scaleDownDelaySeconds", clamped)
    window = [p for t, p in state.proposals if t > now - delay_s] + [clamped]
    highest = max(window)
    if highest >= current:
        return done(current, "stabilizing", f"{why} -> {proposal}, but {highest} within the last {delay_s:g}s", clamped)
    last_down = state.last_scale_down_at_s
    if last_down is not None and now - last_down < settings.scale_down_step_interval_s:
        wait_s = settings.scale_down_step_interval_s - (now - last_down)
        return done(current, "stabilizing", f"{why} -> {proposal}; next scale-down step in {wait_s:.0f}s", clamped)
    step = max(1, math.floor(current * settings.scale_down_max_fraction))
    desired = max(highest, current - step)
    return done(
        desired,
        "scale_down",
        f"{why}; highest proposal over {delay_s:g}s is {highest}, step of at most {step}",
        clamped,
        scaled_down=True,
    )
