"""The scaling policy: ``decide(observation, state, spec, now) -> Decision``. Pure: no I/O, no clock.

Shaped as Ray autoscaler v2's ``schedule()``: a request (observation, state, spec) in, a reply
(count, reason, next state) out, in named steps over one context:

- ``steps.hold_on_stale``: rule 1, before anything is learnt from the observation;
- ``context.read_context``: the numbers of rules 2-3 (load, service time, windows, panic), read once;
- ``signals.SIGNALS``: one function per signal, each a ``Proposal`` (signal, replicas, reason);
  ``signals.strongest`` keeps the largest, clamped to the bounds;
- ``steps.STEPS``: rules 4-6 as ``scale_to_zero``, ``at_zero``, ``above_max``, ``scale_up``,
  ``steady``, ``scale_down``, in that order; the first ``Verdict`` applies, and ``steps.settle``
  folds it into the next state.

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
   so the in-service count grows with each replica started and would keep asking for more.
   In-service concurrency is not demand there, so
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

from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy.context import read_context
from kvfleet.autoscaler.policy.settings import DEFAULT_POLICY, PolicySettings
from kvfleet.autoscaler.policy.signals import strongest
from kvfleet.autoscaler.policy.state import REASONS, Decision, PolicyState, Reason, initial_state
from kvfleet.autoscaler.policy.steps import STEPS, hold_on_stale, settle
from kvfleet.spec import AutoscalingSpec

__all__ = [
    "DEFAULT_POLICY",
    "REASONS",
    "Decision",
    "PolicySettings",
    "PolicyState",
    "Reason",
    "decide",
    "initial_state",
]


def decide(
    observation: Observation,
    state: PolicyState,
    spec: AutoscalingSpec,
    now: float,
    settings: PolicySettings = DEFAULT_POLICY,
) -> Decision:
    """The replica count one deployment should have now, with the reason and the next state."""
    held = hold_on_stale(observation, state, spec, now, settings)
    if held is not None:
        return held
    ctx = read_context(observation, state, spec, now, settings)
    ask = strongest(ctx)
    verdict = next(v for step in STEPS if (v := step(ctx, ask)) is not None)
    return settle(ctx, verdict)
