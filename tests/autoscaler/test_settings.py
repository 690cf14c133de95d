"""AutoscalerSettings nests the policy's knobs; their top-level spelling still works."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet.autoscaler.policy import DEFAULT_POLICY, PolicySettings
from kvfleet.autoscaler.settings import AutoscalerSettings

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
