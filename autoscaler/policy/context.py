"""One fresh tick read once: the load, the service time, the windows and the panic flag.

``read_context`` folds the observation into what the policy has learnt (samples, the service-time
fit, the forecasts) and hands every rule the same frozen ``Context``, so a rule reads numbers and
never recomputes them. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvfleet.autoscaler.forecast import HoltState, SeasonalState, holt_update, seasonal_update
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy.settings import PolicySettings
from kvfleet.autoscaler.policy.state import PolicyState, append_bounded
from kvfleet.autoscaler.service_time import ServiceTimeFit, fit_update, service_time_at
from kvfleet.spec import AutoscalingSpec

ServiceSample = tuple[float, float, int, float]
"""(time, in-service load, ready replicas, router queue)."""


@dataclass(frozen=True, slots=True)
class Context:
    """What every rule reads on a fresh tick."""

    obs: Observation
    spec: AutoscalingSpec
    settings: PolicySettings
    now: float
    prior: PolicyState
    """The state before this tick."""
    learnt: PolicyState
    """The prior state with this tick folded in; the outcome (count, proposals) is not yet in it."""
    horizon_s: float
    """One cold start: the measured one when the operator reported it, else the spec's."""
    backlog_episode: bool
    """The router held requests within the last stable window: the engines are (or were) saturated."""
    service_s: float | None
    """The service time at the target concurrency, once known."""
    load: float
    load_note: str
    """How the load was estimated, when saturated (empty otherwise)."""
    stable_load: float
    panic_load: float
    panicking: bool
    traffic: bool
    """Any load, arrivals or a wake signal on this tick."""
    forecast: HoltState
    """The arrival-rate trend with this tick folded in (also in ``learnt``)."""
    seasonal: SeasonalState
    """The demand's history with this tick folded in (also in ``learnt``)."""
    current: int
    """The count in force before this tick."""
    ready: int
    target: float
    """The spec's per-replica target concurrency."""
    floor: int
    """The least count while not scaled to zero: max(minReplicas, 1)."""


def _learn_service_time(
    state: PolicyState,
    spec: AutoscalingSpec,
    settings: PolicySettings,
    sample: ServiceSample,
    rate: float,
    backlog_episode: bool,
) -> tuple[tuple[ServiceSample, ...], float | None, ServiceTimeFit | None]:
    """(service samples, mean service time, fit against concurrency) with this tick folded in.

    Little's law over the window the arrival rate is measured over (its mean in-service load / its
    rate: a windowed rate against an instant count is biased on every change of load), learnt only
    with no queue in that window (a backlog would inflate it).
    """
    now = sample[0]
    samples = tuple(
        x
        for x in append_bounded(state.service_samples, sample, settings.max_history_samples)
        if x[0] > now - spec.window_seconds
    )
    latency_s, fit = state.latency_s, state.service_fit
    if rate > 0 and not backlog_episode:
        mean_in_service = sum(x[1] for x in samples) / len(samples)
        per_replica = [x[1] / x[2] for x in samples if x[2] > 0]
        if mean_in_service > 0 and per_replica:
            little_s = mean_in_service / rate
            latency_s = little_s if latency_s is None else latency_s + settings.latency_alpha * (little_s - latency_s)
            c_mean = sum(per_replica) / len(per_replica)
            fit = fit_update(fit, c_mean, little_s, now, settings.service_time)
    return samples, latency_s, fit


def _saturated_load(
    spec: AutoscalingSpec,
    now: float,
    sample: ServiceSample,
    samples: tuple[ServiceSample, ...],
    rate: float,
    service_s: float,
    horizon_s: float,
) -> tuple[float, float, str]:
    """(load, demand, note) while the router holds requests and every ready engine is full.

    A full engine holds up to its batch limit (256 in vLLM), far above the target. That count is
    not demand: each replica that turns ready takes a batch from the queue, so counting it would
    ask for more replicas with every one that starts. Demand is the arrival rate x the service
    time (Little's law), plus the backlog drained within one cold start (queue x S / cold start:
    what a replica asked for now can help with); the busy engines count only as a lower bound
    (ready x target: none of them is spare).
    """
    _, in_service, ready, queue = sample
    target = spec.target_concurrency_per_replica
    busy = min(in_service, ready * target)
    # The windowed rate lags an onset by up to a window. The queue does not: it grows by what
    # arrives beyond what the ready replicas serve (at least ready x target / S each), so that
    # sum is a lower bound on the arrival rate now.
    recent = [x for x in samples if x[0] >= now - spec.panic_window_seconds]
    first = recent[0] if recent else sample
    growth_rps = (queue - first[3]) / (now - first[0]) if now > first[0] else 0.0
    arriving = max(rate, growth_rps + ready * target / service_s if growth_rps > 0 else 0.0)
    drain = queue * service_s / max(horizon_s, 1.0)
    demand = max(busy, arriving * service_s)
    note = (
        f" (saturated: max(busy {busy:.0f}, arrivals {arriving:.2f}/s x {service_s:.2f}s) + "
        f"{queue:.0f} queued x {service_s:.2f}s / {horizon_s:g}s)"
    )
    return demand + drain, demand, note


def _mean_since(samples: tuple[tuple[float, float], ...], since_s: float) -> float:
    values = [load for at_s, load in samples if at_s > since_s]
    return sum(values) / len(values) if values else 0.0


def _panic_until(
    state: PolicyState, spec: AutoscalingSpec, settings: PolicySettings, now: float, panic_load: float
) -> float | None:
    """When the panic ends: one stable window after the last tick whose panic-window proposal
    reached ``panic_threshold_ratio`` x the current count."""
    current = state.desired_replicas
    if current > 0 and math.ceil(panic_load / spec.target_concurrency_per_replica) >= (
        settings.panic_threshold_ratio * current
    ):
        return now + spec.window_seconds
    return state.panic_until_s


def read_context(
    obs: Observation, state: PolicyState, spec: AutoscalingSpec, now: float, settings: PolicySettings
) -> Context:
    """Fold a fresh observation into what the policy has learnt, and read the numbers every rule uses."""
    in_service = max(obs.engine_concurrency or 0.0, obs.router_in_flight or 0.0)
    queue = obs.queue_depth or 0.0
    rate = obs.arrival_rate_rps or 0.0
    horizon_s = obs.measured_cold_start_s if obs.measured_cold_start_s is not None else spec.cold_start_seconds
    target = spec.target_concurrency_per_replica
    last_queue = now if queue > 0 else state.last_queue_at_s
    backlog_episode = last_queue is not None and now - last_queue < spec.window_seconds
    sample: ServiceSample = (now, in_service, obs.ready_replicas, queue)
    service_samples, latency_s, service_fit = _learn_service_time(state, spec, settings, sample, rate, backlog_episode)
    # The service time where the replicas will run, at the target concurrency (the mean learnt one
    # until the load seen spreads enough to fit how it grows with the batch).
    fitted_s = service_time_at(service_fit, target, settings.service_time)
    service_s = fitted_s if fitted_s is not None else latency_s
    if backlog_episode and service_s is not None:
        load, demand, load_note = _saturated_load(spec, now, sample, service_samples, rate, service_s, horizon_s)
    else:
        # No queue, or the service time is not known yet (a queued request then counts in full).
        load, demand, load_note = in_service + queue, in_service, ""
    samples = tuple(
        s
        for s in append_bounded(state.samples, (now, load), settings.max_history_samples)
        if s[0] > now - spec.window_seconds
    )
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
    panic_until = _panic_until(state, spec, settings, now, panic_load)
    panicking = panic_until is not None and now < panic_until
    learnt = replace(
        state,
        samples=samples,
        last_traffic_at_s=last_traffic,
        forecast=forecast,
        latency_s=latency_s,
        seasonal=seasonal,
        service_samples=service_samples,
        service_fit=service_fit,
        last_queue_at_s=last_queue,
        panic_until_s=panic_until if panicking else None,
        stale_since_s=None,
    )
    return Context(
        obs=obs,
        spec=spec,
        settings=settings,
        now=now,
        prior=state,
        learnt=learnt,
        horizon_s=horizon_s,
        backlog_episode=backlog_episode,
        service_s=service_s,
        load=load,
        load_note=load_note,
        stable_load=stable_load,
        panic_load=panic_load,
        panicking=panicking,
        traffic=traffic,
        forecast=forecast,
        seasonal=seasonal,
        current=state.desired_replicas,
        ready=obs.ready_replicas,
        target=target,
        floor=max(spec.min_replicas, 1),
    )
