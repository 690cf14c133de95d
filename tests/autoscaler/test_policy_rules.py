"""The policy's named steps one at a time: a context built from a small request, one rule's reply.

``test_policy.py`` checks ``decide`` as a whole; these check that each rule answers for itself
(its signal, replicas and reason) and that ``decide`` combines them in the stated order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy import DEFAULT_POLICY, PolicySettings, PolicyState, decide, initial_state
from kvfleet.autoscaler.policy.context import Context, read_context
from kvfleet.autoscaler.policy.signals import (
    SIGNALS,
    Proposal,
    concurrency,
    gpu_utilization,
    kv_cache,
    strongest,
    ttft,
)
from kvfleet.autoscaler.policy.steps import STEPS, above_max, at_zero, hold_on_stale, scale_down, scale_up
from kvfleet.spec import AutoscalingSpec

SPEC = AutoscalingSpec(
    min_replicas=1,
    max_replicas=10,
    target_concurrency_per_replica=16,
    window_seconds=60,
    panic_window_seconds=6,
    scale_down_delay_seconds=120,
    cold_start_seconds=30,
    ttft_slo_seconds=1.0,
)


def context(
    current: int = 2,
    load: float = 0.0,
    ready: int = 2,
    spec: AutoscalingSpec = SPEC,
    settings: PolicySettings = DEFAULT_POLICY,
    state: PolicyState | None = None,
    **kw: Any,
) -> Context:
    """A fresh tick at t=1000 for a deployment at ``current`` with a history of 1000 s."""
    fields: dict[str, Any] = {"queue_depth": 0.0, "arrival_rate_rps": 0.0, **kw}
    observation = Observation(sampled_at_s=1000.0, ready_replicas=ready, engine_concurrency=load, **fields)
    if state is None:
        state = replace(initial_state(current, 0.0), last_traffic_at_s=999.0)
    return read_context(observation, state, spec, 1000.0, settings)


def test_each_signal_names_itself_its_replicas_and_its_numbers() -> None:
    ctx = context(load=40, kv_cache_utilization=0.9, gpu_utilization=1.0, ttft_p90_s=3.0)
    assert concurrency(ctx) == Proposal("concurrency", 3, "load 40.0 over 60s")
    assert kv_cache(ctx) == Proposal("kv_cache", 3, "KV cache 90% on 2 ready")  # ceil(2 x 0.9 / 0.8)
    assert ttft(ctx) == Proposal("ttft", 4, "TTFT p90 3.00s > SLO 1s on 2 ready")  # factor 3 capped at 2
    assert gpu_utilization(ctx) is None  # no target by default
    with_target = context(load=40, gpu_utilization=1.0, settings=PolicySettings(target_gpu_utilization=0.9))
    assert gpu_utilization(with_target) == Proposal("gpu_utilization", 3, "GPU utilization 100% on 2 ready")


def test_a_signal_with_nothing_to_go_by_proposes_nothing() -> None:
    ctx = context(ready=0, current=2)
    assert kv_cache(ctx) is None and ttft(ctx) is None  # no replica ready: no utilization, no p90 to trust
    assert [p.signal for s in SIGNALS if (p := s(ctx)) is not None] == ["concurrency"]


def test_the_strongest_proposal_wins_and_the_first_on_a_tie() -> None:
    # Concurrency 40 / 16 -> 3 and KV cache -> 3: the tie goes to concurrency, listed first.
    ask = strongest(context(load=40, kv_cache_utilization=0.9))
    assert (ask.proposal.signal, ask.replicas, ask.clamped) == ("concurrency", 3, 3)
    assert ask.why == "concurrency: load 40.0 over 60s / 16 per replica"
    # TTFT asks for 4: it wins, and its reason carries no per-replica target.
    ask = strongest(context(load=40, kv_cache_utilization=0.9, ttft_p90_s=3.0))
    assert (ask.proposal.signal, ask.replicas, ask.why) == ("ttft", 4, "ttft: TTFT p90 3.00s > SLO 1s on 2 ready")
    # Clamped to maxReplicas, the proposal itself kept for the reason.
    ask = strongest(context(load=1000))
    assert (ask.replicas, ask.clamped) == (63, 10)


def test_each_step_answers_only_for_its_own_case() -> None:
    up = context(current=2, load=40)
    ask = strongest(up)
    assert at_zero(up, ask) is None and above_max(up, ask) is None
    verdict = scale_up(up, ask)
    assert verdict is not None and (verdict.replicas, verdict.reason) == (3, "scale_up")
    assert verdict.detail == "concurrency: load 40.0 over 60s / 16 per replica -> 3"
    over = context(current=12, ready=12, load=40)
    verdict = above_max(over, strongest(over))
    assert verdict is not None and (verdict.replicas, verdict.reason) == (10, "clamped")
    # scale_down always answers: here the count is held, the history being shorter than the delay.
    young = context(current=4, ready=4, state=initial_state(4, 950.0))
    verdict = scale_down(young, strongest(young))
    assert (verdict.replicas, verdict.reason, verdict.detail) == (
        4,
        "stabilizing",
        "history 50s < scaleDownDelaySeconds",
    )
    assert STEPS[-1] is scale_down


def test_stale_data_is_held_before_any_rule_runs() -> None:
    state = initial_state(3, 0.0)
    failed = Observation.failed(1000.0, "connection refused", ready_replicas=3)
    held = hold_on_stale(failed, state, SPEC, 1000.0, DEFAULT_POLICY)
    assert held is not None and (held.desired_replicas, held.reason) == (3, "metrics_stale")
    assert decide(failed, state, SPEC, 1000.0) == held
    fresh = Observation(sampled_at_s=1000.0, ready_replicas=3, engine_concurrency=0.0, queue_depth=0.0)
    assert hold_on_stale(fresh, state, SPEC, 1000.0, DEFAULT_POLICY) is None
