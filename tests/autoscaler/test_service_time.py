"""The service-time fit, with numbers that can be checked by hand."""

from __future__ import annotations

import pytest

from kvfleet.autoscaler.service_time import ServiceTimeSettings, fit_update, service_time_at

SETTINGS = ServiceTimeSettings(half_life_s=1e9)  # no forgetting: plain least squares


def test_linear_fit_read_at_the_target() -> None:
    # Points on s = 1 + 0.05 c: (10, 1.5) and (110, 6.5). At c = 90: 1 + 4.5 = 5.5.
    fit = fit_update(None, 10.0, 1.5, 0.0, SETTINGS)
    fit = fit_update(fit, 110.0, 6.5, 1.0, SETTINGS)
    assert service_time_at(fit, 90.0, SETTINGS) == pytest.approx(5.5)


def test_no_spread_no_fit() -> None:
    # Every point at concurrency 10: std 0 < 10% of the target: the caller falls back to the mean.
    fit = fit_update(None, 10.0, 1.5, 0.0, SETTINGS)
    fit = fit_update(fit, 10.0, 1.7, 1.0, SETTINGS)
    assert service_time_at(fit, 90.0, SETTINGS) is None
    assert service_time_at(None, 90.0, SETTINGS) is None


def test_bounds_from_monotone_service_time_and_throughput() -> None:
    # A falling slope (noise) is read as flat: never below the mean point's 4 s above it.
    fit = fit_update(None, 20.0, 5.0, 0.0, SETTINGS)
    fit = fit_update(fit, 40.0, 3.0, 1.0, SETTINGS)
    assert service_time_at(fit, 100.0, SETTINGS) == pytest.approx(4.0)
    # A steep slope is capped where throughput would fall: mean point (30, 2) -> at most 2 x 90/30 = 6.
    fit = fit_update(None, 20.0, 1.0, 0.0, SETTINGS)
    fit = fit_update(fit, 40.0, 3.0, 1.0, SETTINGS)
    assert service_time_at(fit, 90.0, SETTINGS) == pytest.approx(6.0)


def test_old_points_fade() -> None:
    # Half-life 100 s: a point 100 s old weighs half a new one. (10, 1) at t=0, (110, 6) at t=100 and
    # (110, 6) again: the mean point is pulled toward the new ones; the line through both is unchanged.
    s = ServiceTimeSettings(half_life_s=100.0)
    fit = fit_update(None, 10.0, 1.0, 0.0, s)
    fit = fit_update(fit, 110.0, 6.0, 100.0, s)
    assert fit.w == pytest.approx(1.5)
    assert service_time_at(fit, 60.0, s) == pytest.approx(3.5)


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        ServiceTimeSettings(half_life_s=0)
    with pytest.raises(ValueError, match="min_spread_fraction"):
        ServiceTimeSettings(min_spread_fraction=0)
