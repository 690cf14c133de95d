"""The scaling policy, one rule at a time, with numbers that can be checked by hand."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import pytest

from kvfleet.autoscaler.forecast import HoltSettings, HoltState
from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy import Decision, PolicySettings, PolicyState, decide, initial_state
from kvfleet.spec import AutoscalingSpec


def spec(**kw: Any) -> AutoscalingSpec:
    base: dict[str, Any] = {
        "min_replicas": 1,
        "max_replicas": 10,
        "target_concurrency_per_replica": 16,
        "window_seconds": 60,
        "panic_window_seconds": 6,
        "scale_down_delay_seconds": 120,
        "cold_start_seconds": 30,
    }
    base.update(kw)
    return AutoscalingSpec(**base)


def obs(at: float, load: float = 0.0, ready: int = 1, **kw: Any) -> Observation:
    """An observation whose engines hold ``load`` requests; the router sees nothing queued."""
    fields: dict[str, Any] = {
        "sampled_at_s": at,
        "ready_replicas": ready,
        "engine_concurrency": load,
        "queue_depth": 0.0,
        "arrival_rate_rps": 0.0,
    }
    fields.update(kw)
    return Observation(**fields)


def settled(desired: int, now: float = 1000.0, **kw: Any) -> PolicyState:
    """A state with history long enough for scale-down (started 1000 s ago)."""
    return replace(initial_state(desired, now - 1000.0), last_traffic_at_s=now - 1.0, **kw)


def test_scale_up_applies_at_once() -> None:
    # load 40 / 16 per replica = 2.5 -> 3 replicas, from 1, in one decision.
    d = decide(obs(1000, load=40), settled(1), spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (3, "scale_up")
    assert "concurrency" in d.detail


def test_steady_when_proposal_matches() -> None:
    d = decide(obs(1000, load=30, ready=2), settled(2), spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (2, "steady")


def test_stable_window_averages_out_a_short_blip() -> None:
    # 59 samples of load 16 and one of 48: the 60 s mean is (59*16+48)/60 = 16.53 -> 2 replicas,
    # while the 6 s panic window sees (5*16+48)/6 = 21.3 -> 2, below 2 x 1 (no panic, but 2 > 1).
    history = tuple((1000.0 - 60 + i, 16.0) for i in range(1, 60))
    d = decide(obs(1000, load=48), settled(1, samples=history), spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (2, "scale_up")
    assert "over 60s" in d.detail


def test_panic_window_reacts_to_a_burst() -> None:
    # 54 s at load 10, then 6 s at 60 (target 10, 2 replicas). Stable: (54*10 + 6*60)/60 = 15 -> 2.
    # Panic (last 6 s): 60 -> 6 replicas, >= 2.0 x 2: panic, and the panic proposal wins.
    history = tuple((940.0 + i, 10.0 if i <= 54 else 60.0) for i in range(1, 60))
    d = decide(obs(1000, load=60, ready=2), settled(2, samples=history), spec(target_concurrency_per_replica=10), 1000)
    assert (d.desired_replicas, d.reason) == (6, "panic_scale_up")
    assert d.state.panic_until_s == 1060.0


def test_no_scale_down_while_panicking() -> None:
    state = settled(6, panic_until_s=1030.0)
    d = decide(obs(1000, load=0, ready=6), state, spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (6, "panic_hold")
    # Panic ends after one stable window; then the normal delayed scale-down applies.
    d = decide(obs(1031, load=0, ready=6), replace(state, proposals=()), spec(), now=1031)
    assert d.reason == "scale_down"


def test_scale_down_waits_for_the_delay() -> None:
    # A proposal of 4 was made 100 s ago; the delay is 120 s, so 4 replicas stay.
    state = settled(4, proposals=((900.0, 4), (950.0, 1)))
    d = decide(obs(1000, load=0, ready=4), state, spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (4, "stabilizing")
    # 21 s later the 4 has left the 120 s window: the highest proposal is 1.
    d = decide(obs(1021, load=0, ready=4), d.state, spec(), now=1021)
    assert d.reason == "scale_down"


def test_scale_down_is_step_bounded() -> None:
    # From 8 with every proposal at 1: at most a quarter (2) go per step, one step per 30 s.
    state = settled(8)
    d = decide(obs(1000, load=0, ready=8), state, spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (6, "scale_down")
    d = decide(obs(1010, load=0, ready=6), d.state, spec(), now=1010)
    assert (d.desired_replicas, d.reason) == (6, "stabilizing")
    assert "next scale-down step in 20s" in d.detail
    d = decide(obs(1030, load=0, ready=6), d.state, spec(), now=1030)
    assert (d.desired_replicas, d.reason) == (5, "scale_down")  # floor(6 x 0.25) = 1
    # With half allowed per step (Knative's max-scale-down-rate 2): 8 -> 4 -> 2.
    half = PolicySettings(scale_down_max_fraction=0.5)
    d = decide(obs(1000, load=0, ready=8), state, spec(), now=1000, settings=half)
    assert d.desired_replicas == 4
    d = decide(obs(1030, load=0, ready=4), d.state, spec(), now=1030, settings=half)
    assert d.desired_replicas == 2


def test_no_scale_down_before_history_covers_the_delay() -> None:
    # A restarted autoscaler knows nothing of the last 120 s: it keeps what is there.
    state = initial_state(5, now_s=950.0)
    d = decide(obs(1000, load=0, ready=5), state, spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (5, "stabilizing")


def test_forecast_adds_capacity_before_the_demand_arrives() -> None:
    # alpha = beta = 1: level follows the last rate, trend the last slope. Rates 11 -> 12 req/s
    # one second apart: trend 1 req/s per s, 30 s ahead (the cold start) 42 req/s. Latency 0.5 s
    # (load 6 / rate 12), so the growth is (42 - 12) x 0.5 = 15 requests: (6 + 15) / 8 -> 3 replicas.
    # Concurrency alone says ceil(6 / 8) = 1.
    settings = PolicySettings(forecast=HoltSettings(level_alpha=1.0, trend_beta=1.0))
    state = settled(1, forecast=HoltState(level_rps=11.0, trend_rps_per_s=1.0, at_s=999.0), latency_s=0.5)
    s = spec(target_concurrency_per_replica=8)
    d = decide(obs(1000, load=6, arrival_rate_rps=12.0), state, s, now=1000, settings=settings)
    assert (d.desired_replicas, d.reason) == (3, "forecast_scale_up")
    assert "12.00/s -> 42.00/s in 30s" in d.detail


def test_forecast_uses_the_measured_cold_start() -> None:
    settings = PolicySettings(forecast=HoltSettings(level_alpha=1.0, trend_beta=1.0))
    state = settled(1, forecast=HoltState(level_rps=11.0, trend_rps_per_s=1.0, at_s=999.0), latency_s=0.5)
    o = obs(1000, load=6, arrival_rate_rps=12.0, measured_cold_start_s=90.0)
    # 90 s ahead: 102 req/s; growth (102 - 12) x 0.5 = 45, capped at 3 x max(6, 8) = 24: (6 + 24) / 8 -> 4.
    d = decide(o, state, spec(target_concurrency_per_replica=8), now=1000, settings=settings)
    assert (d.desired_replicas, d.reason) == (4, "forecast_scale_up")


def test_flat_forecast_adds_nothing() -> None:
    state = settled(1, forecast=HoltState(level_rps=12.0, trend_rps_per_s=0.0, at_s=999.0), latency_s=0.5)
    d = decide(obs(1000, load=6, arrival_rate_rps=12.0), state, spec(target_concurrency_per_replica=8), now=1000)
    assert (d.desired_replicas, d.reason) == (1, "steady")


def test_kv_cache_gpu_and_ttft_signals() -> None:
    # KV 90% on 2 ready, target 80%: ceil(2 x 0.9 / 0.8) = ceil(2.25) = 3.
    d = decide(obs(1000, load=2, ready=2, kv_cache_utilization=0.9), settled(2), spec(), now=1000)
    assert (d.desired_replicas, d.reason) == (3, "scale_up")
    assert "kv_cache" in d.detail
    # DCGM 100% on 2 ready, target 90%: ceil(2.22) = 3 -- only with a target set; by default the
    # saturating DCGM utilization proposes nothing.
    gpu = PolicySettings(target_gpu_utilization=0.9)
    d = decide(obs(1000, load=2, ready=2, gpu_utilization=1.0), settled(2), spec(), now=1000, settings=gpu)
    assert d.desired_replicas == 3 and "gpu_utilization" in d.detail
    d = decide(obs(1000, load=2, ready=2, gpu_utilization=1.0), settled(2), spec(), now=1000)
    assert "gpu_utilization" not in d.detail and d.desired_replicas <= 2
    # TTFT p90 3 s against a 1 s SLO on 2 ready: the factor 3 is capped at 2 -> 4.
    d = decide(obs(1000, load=2, ready=2, ttft_p90_s=3.0), settled(2), spec(ttft_slo_seconds=1.0), now=1000)
    assert d.desired_replicas == 4 and "ttft" in d.detail
    # It lags, so it waits: not while replicas start (ready 2 of 3), and once per 60 s window +
    # 30 s cold start after it acted.
    d = decide(obs(1000, load=2, ready=2, ttft_p90_s=3.0), settled(3), spec(ttft_slo_seconds=1.0), now=1000)
    assert "ttft" not in d.detail
    acted = settled(2, last_scale_up_at_s=920.0)
    d = decide(obs(1000, load=2, ready=2, ttft_p90_s=3.0), acted, spec(ttft_slo_seconds=1.0), now=1000)
    assert "ttft" not in d.detail
    d = decide(obs(1010, load=2, ready=2, ttft_p90_s=3.0), acted, spec(ttft_slo_seconds=1.0), now=1010)
    assert d.desired_replicas == 4 and d.state.last_scale_up_at_s == 1010
    # Within the SLO the TTFT signal proposes nothing.
    d = decide(obs(1000, load=2, ready=2, ttft_p90_s=0.5), settled(2), spec(ttft_slo_seconds=1.0), now=1000)
    assert "ttft" not in d.detail


def test_router_queue_counts_as_load() -> None:
    # Engines hold 16, the router in-flight 20 (max: 20), plus 28 queued = 48 -> 3 replicas.
    o = obs(1000, load=16, ready=1, router_in_flight=20.0, queue_depth=28.0)
    d = decide(o, settled(1), spec(), now=1000)
    assert d.desired_replicas == 3


def test_queue_counts_as_drain_load_once_service_time_is_known() -> None:
    # Service time 6 s (learnt earlier), cold start 30 s: 300 queued count as 300 x 6 / 30 = 60.
    # The one ready engine is full (100 = the target): it counts as busy 100, and the arrivals as
    # 20/s x 6 s = 120 (Little's law). max(100, 120) + 60 = 180 -> ceil(180 / 100) = 2, not
    # (100 + 300) / 100 = 4.
    state = settled(1, latency_s=6.0)
    o = obs(1000, load=100, queue_depth=300.0, arrival_rate_rps=20.0)
    d = decide(o, state, spec(target_concurrency_per_replica=100), now=1000)
    assert d.desired_replicas == 2
    assert "saturated: max(busy 100, arrivals 20.00/s x 6.00s) + 300 queued x 6.00s / 30s" in d.detail
    assert d.state.latency_s == 6.0  # not learnt while requests queue
    # 40/s: 240 + 60 = 300 -> 3.
    d = decide(replace(o, arrival_rate_rps=40.0), state, spec(target_concurrency_per_replica=100), now=1000)
    assert d.desired_replicas == 3


def test_saturated_engines_count_at_the_target_so_each_ready_replica_adds_nothing() -> None:
    # Target 100, service time 6 s, cold start 30 s, arrivals 40/s (240 in service at the target).
    # t=1000: 1 ready engine full at 256, 1000 queued: max(min(256, 100), 240) + 1000 x 6 / 30 = 440
    # -> 5 replicas. t=1002: a second replica turned ready and took 256 from the queue (512 in
    # service, 744 queued): max(200, 240) + 148.8 = 388.8; the 6 s mean (440 + 388.8) / 2 = 414.4
    # -> still 5. Counting the in-service requests, 512 + 744 x 6 / 30 = 660.8 would ask for 7.
    s = spec(target_concurrency_per_replica=100, max_replicas=20)
    state = settled(1, latency_s=6.0)
    d = decide(obs(1000, load=256, queue_depth=1000.0, arrival_rate_rps=40.0), state, s, now=1000)
    assert d.desired_replicas == 5
    d = decide(obs(1002, load=512, ready=2, queue_depth=744.0, arrival_rate_rps=40.0), d.state, s, now=1002)
    assert (d.desired_replicas, d.reason) == (5, "steady")
    # The queue has drained into the engines (3 ready, 900 in service, none queued): within one
    # window of the last queue the engines still hold backlog, so they count as 3 x 100, not 900.
    d = decide(obs(1030, load=900, ready=3, arrival_rate_rps=40.0), replace(d.state, samples=()), s, now=1030)
    assert d.desired_replicas == 5  # 300 -> 3 now, but 5 stays within the scale-down delay
    assert "load 300.0 over 60s (saturated: max(busy 300, arrivals 40.00/s x 6.00s) + 0 queued" in d.detail


def test_a_growing_queue_is_a_lower_bound_on_the_arrival_rate() -> None:
    # The 1-minute rate lags an onset (it still reads 10/s). The queue grew from 100 to 300 in 4 s:
    # 50/s beyond what the one ready engine serves (at least 100 / 6 s = 16.7/s), so at least
    # 66.7/s arrive: 66.7 x 6 = 400 in service at the target, + 300 x 6 / 30 = 60 queued -> 460.
    # The first tick had no growth to go by: max(100, 10 x 6) + 20 = 120. Mean (120 + 460) / 2 = 290
    # -> 3 replicas (with the lagging rate alone: (120 + 160) / 2 = 140 -> 2).
    s = spec(target_concurrency_per_replica=100)
    state = settled(1, latency_s=6.0)
    d = decide(obs(1000, load=256, queue_depth=100.0, arrival_rate_rps=10.0), state, s, now=1000)
    assert d.desired_replicas == 2
    d = decide(obs(1004, load=256, queue_depth=300.0, arrival_rate_rps=10.0), d.state, s, now=1004)
    assert d.desired_replicas == 3
    assert "arrivals 66.67/s x 6.00s" in d.detail


def test_service_time_is_learnt_over_the_rate_window_and_read_at_the_target() -> None:
    # Little's law over the window the rate is measured over: 60 s of in-service 10 on 1 replica at
    # 5/s -> 2 s. The fit needs spread: with every point at concurrency 10 it falls back to the mean.
    s = spec(target_concurrency_per_replica=100)
    state = settled(1, samples=())
    for t in range(940, 1001, 2):
        state = decide(obs(float(t), load=10, arrival_rate_rps=5.0), state, s, now=float(t)).state
    assert state.latency_s == pytest.approx(2.0)
    assert state.service_fit is not None and state.service_fit.w > 20
    # After load at 100 per replica and 12.5/s (8 s): the fit reads 8 s at the target, and a
    # forecast's growth is turned into load with it, not with the mean of the two.
    for t in range(1002, 1200, 2):
        state = decide(obs(float(t), load=100, arrival_rate_rps=12.5), state, s, now=float(t)).state
    from kvfleet.autoscaler.service_time import ServiceTimeSettings, service_time_at

    assert service_time_at(state.service_fit, 100.0, ServiceTimeSettings()) == pytest.approx(8.0, rel=0.02)


def test_ttft_breach_left_by_a_drained_backlog_adds_nothing() -> None:
    # The queue emptied 30 s ago; the p90 over the last minute still holds requests that waited in
    # it. That breach is the backlog's (already counted as load), so TTFT proposes nothing for one
    # window after the last queued request; then it acts again.
    s = spec(ttft_slo_seconds=1.0)
    state = settled(2, last_queue_at_s=970.0, proposals=((990.0, 2),))
    d = decide(obs(1000, load=2, ready=2, ttft_p90_s=3.0), state, s, now=1000)
    assert (d.desired_replicas, d.reason) == (2, "stabilizing") and not d.detail.startswith("ttft")
    d = decide(obs(1030, load=2, ready=2, ttft_p90_s=3.0), state, s, now=1030)
    assert d.desired_replicas == 4 and d.detail.startswith("ttft: TTFT p90 3.00s")


def test_clamped_to_max_and_min() -> None:
    d = decide(obs(1000, load=1000), settled(1), spec(max_replicas=4), now=1000)
    assert (d.desired_replicas, d.reason) == (4, "scale_up")
    assert "capped at maxReplicas 4" in d.detail
    # maxReplicas lowered below the current count: applied at once.
    d = decide(obs(1000, load=0, ready=6), settled(6), spec(max_replicas=4), now=1000)
    assert (d.desired_replicas, d.reason) == (4, "clamped")
    # minReplicas raised above it: applied at once too.
    d = decide(obs(1000, load=0), settled(1), spec(min_replicas=3), now=1000)
    assert (d.desired_replicas, d.reason) == (3, "clamped")


def test_scale_to_zero_after_idle_time() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=300)
    state = replace(settled(1), last_traffic_at_s=700.0)
    # 299 s idle: keep one replica (an idle deployment with minReplicas 0 still keeps 1 until then).
    d = decide(obs(999, load=0), state, s, now=999)
    assert (d.desired_replicas, d.reason) == (1, "steady")
    d = decide(obs(1000, load=0), state, s, now=1000)
    assert (d.desired_replicas, d.reason) == (0, "scale_to_zero")
    assert "no traffic for 300s" in d.detail
    # Arrivals (even with nothing in flight yet) count as traffic.
    d = decide(obs(1000, load=0, arrival_rate_rps=0.1), state, s, now=1000)
    assert d.desired_replicas == 1


def test_never_zero_without_scale_to_zero() -> None:
    state = replace(settled(1), last_traffic_at_s=0.0)
    d = decide(obs(1000, load=0), state, spec(min_replicas=0), now=1000)
    assert d.desired_replicas == 0  # minReplicas 0 alone means the default 300 s applies
    d = decide(obs(1000, load=0), state, spec(min_replicas=1), now=1000)
    assert d.desired_replicas == 1


def test_wake_from_zero() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=300)
    at_zero = settled(0)
    d = decide(obs(1000, load=0, ready=0), at_zero, s, now=1000)
    assert (d.desired_replicas, d.reason) == (0, "steady")
    d = decide(obs(1000, load=0, ready=0, wake_requested=True), at_zero, s, now=1000)
    assert (d.desired_replicas, d.reason) == (1, "wake")
    # 40 requests held by the router: ceil(40 / 16) = 3 at once.
    d = decide(obs(1000, ready=0, engine_concurrency=None, queue_depth=40.0), at_zero, s, now=1000)
    assert (d.desired_replicas, d.reason) == (3, "wake")


def test_no_router_series_at_zero_is_no_traffic() -> None:
    # A router that never saw the model has no series for it: at zero that is not a stale episode.
    s = spec(min_replicas=0, scale_to_zero_after_seconds=300)
    d = decide(obs(1000, ready=0, engine_concurrency=None, queue_depth=None), settled(0), s, now=1000)
    assert (d.desired_replicas, d.reason) == (0, "steady")


def test_wake_works_even_when_metrics_are_stale() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=300)
    d = decide(Observation.failed(1000, "connection refused", wake_requested=True), settled(0), s, now=1000)
    assert (d.desired_replicas, d.reason) == (1, "wake")


@pytest.mark.parametrize(
    ("observation", "problem"),
    [
        (Observation.failed(1000, "connection refused", ready_replicas=3), "connection refused"),
        (obs(969, load=0, ready=3), "31s old"),
        (obs(1000, ready=3, engine_concurrency=None), "no concurrency metrics while 3 replicas are ready"),
        (obs(1000, load=math.nan, ready=3), "engine_concurrency is nan"),
        (obs(1000, ready=0, engine_concurrency=None, queue_depth=None, arrival_rate_rps=None), "no router metrics"),
        (obs(1000, ready=3, queue_depth=-1.0), "queue_depth is -1.0"),
        (obs(1000, ready=3, kv_cache_utilization=57.0), "kv_cache_utilization is 57.0, outside [0, 1]"),
        (obs(1000, ready=3, gpu_utilization=1.5), "gpu_utilization is 1.5, outside [0, 1]"),
    ],
)
def test_stale_or_missing_metrics_hold(observation: Observation, problem: str) -> None:
    # Idle for far longer than the scale-to-zero delay, yet nothing is removed on bad data.
    s = spec(min_replicas=0, scale_to_zero_after_seconds=60)
    state = replace(settled(3), last_traffic_at_s=0.0)
    d = decide(observation, state, s, now=1000)
    assert (d.desired_replicas, d.reason) == (3, "metrics_stale")
    assert problem in d.detail
    assert d.state.stale_since_s == 1000
    # The episode keeps its start; fresh data ends it, and the idle clock restarted at the stale tick.
    d2 = decide(observation, d.state, s, now=1001)
    assert d2.state.stale_since_s == 1000
    d3 = decide(obs(1002, load=0, ready=3), d2.state, s, now=1002)
    assert d3.state.stale_since_s is None
    assert d3.desired_replicas == 3  # the held 3 is among the proposals of the last 120 s
    # Zero comes only 60 s of fresh idle observations after recovery, however long ago the last
    # stale tick was.
    assert d3.state.last_traffic_at_s == 1002
    d4 = decide(obs(1061, load=0, ready=3), d3.state, s, now=1061)
    assert d4.desired_replicas == 3
    d5 = decide(obs(1062, load=0, ready=3), d4.state, s, now=1062)
    assert (d5.desired_replicas, d5.reason) == (0, "scale_to_zero")


def test_stale_hold_also_blocks_scale_down_after_recovery() -> None:
    state = settled(4)
    d = decide(Observation.failed(1000, "timeout", ready_replicas=4), state, spec(), now=1000)
    d = decide(obs(1010, load=0, ready=4), d.state, spec(), now=1010)
    assert (d.desired_replicas, d.reason) == (4, "stabilizing")


def run_trace(loads: list[float], s: AutoscalingSpec, start: int = 1) -> list[Decision]:
    state = initial_state(start, 0.0)
    out = []
    for t, load in enumerate(loads):
        d = decide(obs(float(t), load=load, ready=state.desired_replicas), state, s, now=float(t))
        out.append(d)
        state = d.state
    return out


def test_alternating_load_does_not_flap() -> None:
    # 10 minutes of load alternating 40 / 0 every 30 s (target 16). The first tick sees 40 -> 3; the
    # 60 s mean then settles at 20 -> 2 and, with a 120 s delay over proposals of 2 and 3, one step
    # down to 2 follows. It never goes back up and down again.
    loads = [40.0 if (t // 30) % 2 == 0 else 0.0 for t in range(600)]
    decisions = run_trace(loads, spec())
    counts = [d.desired_replicas for d in decisions]
    changes = [(t + 1, b) for t, (a, b) in enumerate(itertools.pairwise(counts)) if a != b]
    assert counts[0] == 3
    assert [n for _, n in changes] == [2]
    assert counts[-1] == 2


def test_scale_down_after_load_goes_away() -> None:
    # 60 s of load 64 (4 replicas), then nothing. At tick t the 60 s window holds 119 - t high
    # samples, so the proposal is 4 until t = 73, 3 until 88, 2 until 103, then 1. The last 4 leaves
    # the 120 s window at t = 193: down to the highest remaining proposal, 3 (step <= 2). Then one
    # step of floor(3 x 0.5) = 1 per 30 s: 2 at 223, 1 at 253.
    loads = [64.0] * 60 + [0.0] * 400
    decisions = run_trace(loads, spec())
    downs = [(t, d.desired_replicas) for t, d in enumerate(decisions) if d.reason == "scale_down"]
    assert downs == [(193, 3), (223, 2), (253, 1)]


def test_policy_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="panic_threshold_ratio"):
        PolicySettings(panic_threshold_ratio=0.5)
    with pytest.raises(ValueError, match="level_alpha"):
        HoltSettings(level_alpha=0.0)


def test_seasonal_forecast_pre_scales_a_repeating_burst() -> None:
    # Load 64 for 2 min every 5 min, 8 in between (target 16: 4 replicas in a burst, 1 between).
    # The bursts at 0 and 300 s are met by the concurrency and panic rules (at 300: panic, 2 -> 4
    # within 4 s). By 540 s the history holds the repeat: period 300 s. At 540 the stable window a
    # cold start ahead, [570, 630), was [270, 330) one period ago: 10 s bins 27..32, three at 8 and
    # three at 64, mean 36 -> 3 replicas. At 560: bins 29..34, (8 + 5 x 64) / 6 = 54.7 -> 4.
    # So the third burst, at 600, finds 4 replicas already asked for: no panic.
    loads = [64.0 if t % 300 < 120 else 8.0 for t in range(700)]
    decisions = run_trace(loads, spec(scale_down_delay_seconds=30))
    assert decisions[300].reason == "panic_scale_up"
    assert (decisions[540].desired_replicas, decisions[540].reason) == (3, "forecast_scale_up")
    assert "seasonal: period 300s" in decisions[540].detail and "load 36.0" in decisions[540].detail
    assert (decisions[560].desired_replicas, decisions[560].reason) == (4, "forecast_scale_up")
    assert decisions[599].desired_replicas == 4
    assert all(d.reason != "panic_scale_up" for d in decisions[560:700])


def test_at_zero_with_min_replicas_comes_up_to_the_floor_without_traffic() -> None:
    # A deployment that starts at zero (new, or autoscaling just turned on) with minReplicas 2 is
    # raised to 2 at once; minReplicas 0 stays at zero until traffic or a wake arrives.
    d = decide(obs(1000, load=0, ready=0), settled(0), spec(min_replicas=2), now=1000)
    assert (d.desired_replicas, d.reason) == (2, "clamped")
    assert "minReplicas 2" in d.detail
    d = decide(obs(1000, load=0, ready=0), settled(0), spec(min_replicas=0), now=1000)
    assert (d.desired_replicas, d.reason) == (0, "steady")
