"""AutoscalerSettings nests each part's knobs (loop, Prometheus, Lease, policy); the flat spelling still works."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet.autoscaler.policy import DEFAULT_POLICY, PolicySettings
from kvfleet.autoscaler.settings import (
    TICK_INTERVAL_BOUNDS_S,
    AutoscalerSettings,
    ControllerSettings,
    LeaseSettings,
    PrometheusSourceSettings,
)
from kvfleet.local.settings import LocalSettings, LocalSettingsError

BASE: dict[str, Any] = {"prometheus_url": "http://prometheus:9090", "identity": "autoscaler-0"}


def test_policy_knobs_are_nested_with_their_defaults() -> None:
    assert AutoscalerSettings(**BASE).policy == DEFAULT_POLICY
    nested = AutoscalerSettings(**BASE, policy={"latency_alpha": 0.5, "forecast": {"level_alpha": 1.0}})
    assert nested.policy.latency_alpha == 0.5 and nested.policy.forecast.level_alpha == 1.0


def test_top_level_policy_knobs_still_work_and_go_into_policy() -> None:
    settings = AutoscalerSettings(
        **BASE,
        max_metrics_age_s=10,
        panic_threshold_ratio=3,
        scale_down_max_fraction=0.5,
        scale_down_step_interval_s=0,
        target_gpu_utilization=0.9,
        policy=PolicySettings(latency_alpha=0.5),
    )
    assert settings.policy == PolicySettings(
        max_metrics_age_s=10,
        panic_threshold_ratio=3,
        scale_down_max_fraction=0.5,
        scale_down_step_interval_s=0,
        target_gpu_utilization=0.9,
        latency_alpha=0.5,
    )


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"max_metrics_age_s": 0}, "max_metrics_age_s=0"),
        ({"panic_threshold_ratio": 101}, "panic_threshold_ratio=101"),
        ({"policy": {"scale_down_max_fraction": 1.5}}, "scale_down_max_fraction=1.5"),
        ({"policy": {"no_such_knob": 1}}, "policy.no_such_knob"),
    ],
)
def test_a_bad_policy_knob_is_named(values: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        AutoscalerSettings(**BASE, **values)  # type: ignore[arg-type]
    problems = [(".".join(map(str, e["loc"])), e["msg"]) for e in caught.value.errors()]
    assert any(named in f"{where} {msg}" for where, msg in problems), problems


def test_flat_command_line_names_go_into_their_parts() -> None:
    settings = AutoscalerSettings(
        **BASE,
        tick_interval_s=0.5,
        max_deployments=10,
        prometheus_timeout_s=2,
        rate_window="30s",
        lease_namespace="kvfleet",
        retry_period_s=1,
    )
    assert settings.loop == ControllerSettings(tick_interval_s=0.5, max_deployments=10)
    assert settings.prometheus == PrometheusSourceSettings(url=BASE["prometheus_url"], timeout_s=2, rate_window="30s")
    assert settings.lease == LeaseSettings(namespace="kvfleet", identity="autoscaler-0", retry_period_s=1)
    assert AutoscalerSettings(prometheus_url=BASE["prometheus_url"], leader_election=False).lease is None


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"tick_interval_s": 0.01}, "loop tick_interval_s must be in [0.05, 60.0]"),
        ({"prometheus_timeout_s": 120}, "prometheus timeout_s must be in (0, 60]"),
        ({"rate_window": "1h"}, "prometheus rate_window must be a PromQL duration"),
        ({"renew_deadline_s": 20}, "lease need 0 < retry_period_s < renew_deadline_s < lease_duration_s"),
    ],
)
def test_a_bad_part_knob_is_named_with_its_part(values: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        AutoscalerSettings(**BASE, **values)  # type: ignore[arg-type]
    problems = [
        f"{'.'.join(map(str, e['loc']))} {e['msg'].removeprefix('Value error, ')}" for e in caught.value.errors()
    ]
    assert any(p.startswith(named) for p in problems), problems


def test_local_mode_and_the_cluster_share_one_tick_bound() -> None:
    # Both run the same control loop: the cluster's old 0.1 s floor and the loop's own 0.01 s disagreed.
    low, high = TICK_INTERVAL_BOUNDS_S
    ControllerSettings(tick_interval_s=low)
    LocalSettings(tick_s=low)
    with pytest.raises(ValueError, match="tick_interval_s"):
        ControllerSettings(tick_interval_s=low / 2)
    with pytest.raises(LocalSettingsError, match="tick_s"):
        LocalSettings(tick_s=high * 2)
