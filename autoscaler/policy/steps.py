"""What applies of the strongest proposal: one function per rule, each a ``Verdict`` or None.

``STEPS`` run in order and the first verdict wins; a rule may assume the ones before it passed
(``scale_up`` never sees a count above maxReplicas, ``scale_down`` only a smaller proposal).
Before any of them, ``hold_on_stale`` holds the count when the observation cannot be trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy.context import Context
from kvfleet.autoscaler.policy.settings import PolicySettings
from kvfleet.autoscaler.policy.signals import Ask, Signal
from kvfleet.autoscaler.policy.state import Decision, PolicyState, Reason, append_bounded, clamp
from kvfleet.spec import AutoscalingSpec


@dataclass(frozen=True, slots=True)
class Verdict:
    """The count one rule sets, its reason code and numbers, and the proposal the scale-down window
    keeps for this tick."""

    replicas: int
    reason: Reason
    detail: str
    recorded: int
    scaled_down: bool = False


def stale_problem(obs: Observation, current: int, now_s: float, settings: PolicySettings) -> str | None:
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


def hold_on_stale(
    obs: Observation, state: PolicyState, spec: AutoscalingSpec, now: float, settings: PolicySettings
) -> Decision | None:
    """Fail safe: hold the count on data that cannot be trusted (never scale to zero on absent data).

    The idle clock restarts, since idleness was not observed; a router wake still wakes a
    deployment at zero (the wake is itself evidence of demand).
    """
    problem = stale_problem(obs, state.desired_replicas, now, settings)
    if problem is None:
        return None
    held = clamp(state.desired_replicas, spec.min_replicas, spec.max_replicas)
    reason: Reason = "metrics_stale"
    detail = f"holding {held}: {problem}"
    if held == 0 and obs.wake_requested:
        held, reason = max(spec.min_replicas, 1), "wake"
        detail = f"router wake signal at zero replicas (metrics stale: {problem})"
    stale_state = replace(
        state,
        desired_replicas=held,
        last_traffic_at_s=now,
        proposals=append_bounded(state.proposals, (now, held), settings.max_history_samples),
        stale_since_s=state.stale_since_s if state.stale_since_s is not None else now,
    )
    return Decision(held, reason, detail, stale_state)


def scale_to_zero(ctx: Context, ask: Ask) -> Verdict | None:
    """Zero after ``scaleToZeroAfterSeconds`` with no traffic at all (fresh observations only)."""
    zero_after_s = ctx.spec.effective_scale_to_zero_after_s
    idle_s = ctx.now - ctx.learnt.last_traffic_at_s
    if zero_after_s is None or ctx.traffic or idle_s < zero_after_s:
        return None
    idle = f"no traffic for {idle_s:.0f}s (scale to zero after {zero_after_s:g}s)"
    return Verdict(0, "scale_to_zero" if ctx.current > 0 else "steady", idle, recorded=0)


def at_zero(ctx: Context, ask: Ask) -> Verdict | None:
    """At zero: wake at once on any traffic; up to minReplicas without waiting for any."""
    if ctx.current != 0:
        return None
    spec = ctx.spec
    if not ctx.traffic and spec.min_replicas > 0:
        # A deployment created (or left) at zero with minReplicas > 0 is brought up to its floor
        # without waiting for traffic: minReplicas is a promise of warm capacity.
        floor_note = f"0 is below minReplicas {spec.min_replicas}"
        return Verdict(spec.min_replicas, "clamped", floor_note, recorded=spec.min_replicas)
    if not ctx.traffic:
        return Verdict(0, "steady", "at zero, no traffic", recorded=0)
    woken = clamp(max(ask.replicas, ctx.floor), ctx.floor, spec.max_replicas)
    cause = "router wake signal" if ctx.obs.wake_requested else f"traffic at zero replicas (load {ctx.load:.1f})"
    return Verdict(woken, "wake", f"{cause}; {ask.why}", recorded=woken)


def above_max(ctx: Context, ask: Ask) -> Verdict | None:
    """maxReplicas lowered below the count: applied at once."""
    top = ctx.spec.max_replicas
    if ctx.current <= top:
        return None
    return Verdict(top, "clamped", f"{ctx.current} is above maxReplicas {top}", recorded=ask.clamped)


SCALE_UP_REASONS: dict[Signal, Reason] = {
    "panic": "panic_scale_up",
    "forecast": "forecast_scale_up",
    "seasonal": "forecast_scale_up",
}
"""The reason a scale-up gives by the signal that won (any other: ``scale_up``)."""


def scale_up(ctx: Context, ask: Ask) -> Verdict | None:
    """A larger (clamped) proposal applies at once."""
    if ask.clamped <= ctx.current:
        return None
    if ask.replicas < ctx.floor:
        return Verdict(ask.clamped, "clamped", f"{ctx.current} is below the floor {ctx.floor}", recorded=ask.clamped)
    reason = SCALE_UP_REASONS.get(ask.proposal.signal, "scale_up")
    top = ctx.spec.max_replicas
    capped = f" (capped at maxReplicas {top})" if ask.replicas > top else ""
    return Verdict(ask.clamped, reason, f"{ask.why} -> {ask.replicas}{capped}", recorded=ask.clamped)


def steady(ctx: Context, ask: Ask) -> Verdict | None:
    """The (clamped) proposal is the count in force."""
    if ask.clamped != ctx.current:
        return None
    return Verdict(ctx.current, "steady", f"{ask.why} -> {ask.replicas}", recorded=ask.clamped)


def scale_down(ctx: Context, ask: Ask) -> Verdict:
    """A smaller proposal applies slowly: not while panicking, not before the history covers the
    delay, only when every proposal over ``scaleDownDelaySeconds`` is smaller, one step per
    ``scale_down_step_interval_s``, at most ``scale_down_max_fraction`` of the replicas a step."""
    current, now, settings, delay_s = ctx.current, ctx.now, ctx.settings, ctx.spec.scale_down_delay_seconds
    proposed = f"{ask.why} -> {ask.replicas}"

    def hold(detail: str) -> Verdict:
        return Verdict(current, "stabilizing", detail, recorded=ask.clamped)

    if ctx.panicking:
        until_s = ctx.learnt.panic_until_s
        return Verdict(current, "panic_hold", f"panicking until {until_s:.0f}; {proposed}", recorded=ask.clamped)
    if now - ctx.prior.started_at_s < delay_s:
        return hold(f"history {now - ctx.prior.started_at_s:.0f}s < scaleDownDelaySeconds")
    highest = max([p for t, p in ctx.prior.proposals if t > now - delay_s] + [ask.clamped])
    if highest >= current:
        return hold(f"{proposed}, but {highest} within the last {delay_s:g}s")
    last_down = ctx.prior.last_scale_down_at_s
    if last_down is not None and now - last_down < settings.scale_down_step_interval_s:
        wait_s = settings.scale_down_step_interval_s - (now - last_down)
        return hold(f"{proposed}; next scale-down step in {wait_s:.0f}s")
    step = max(1, math.floor(current * settings.scale_down_max_fraction))
    detail = f"{ask.why}; highest proposal over {delay_s:g}s is {highest}, step of at most {step}"
    return Verdict(max(highest, current - step), "scale_down", detail, recorded=ask.clamped, scaled_down=True)


STEPS: tuple[Callable[[Context, Ask], Verdict | None], ...] = (
    scale_to_zero,
    at_zero,
    above_max,
    scale_up,
    steady,
    scale_down,
)
"""The rules in the order they apply; ``scale_down`` always answers."""


def settle(ctx: Context, verdict: Verdict) -> Decision:
    """The decision, with the next state: what was learnt plus this tick's outcome."""
    prior, now = ctx.prior, ctx.now
    kept = tuple(p for p in prior.proposals if p[0] > now - ctx.spec.scale_down_delay_seconds)
    state = replace(
        ctx.learnt,
        last_scale_up_at_s=now if verdict.replicas > prior.desired_replicas else prior.last_scale_up_at_s,
        desired_replicas=verdict.replicas,
        proposals=append_bounded(kept, (now, verdict.recorded), ctx.settings.max_history_samples),
        last_scale_down_at_s=now if verdict.scaled_down else prior.last_scale_down_at_s,
    )
    return Decision(verdict.replicas, verdict.reason, verdict.detail, state)
