"""The seasonal forecast: period detection and look-up, with numbers that can be checked by hand."""

from __future__ import annotations

import pytest

from kvfleet.autoscaler.forecast import SeasonalSettings, find_period, seasonal_forecast, seasonal_update

S = SeasonalSettings()  # 10 s bins, periods >= 120 s


def square(
    periods: float, high_bins: int = 12, period_bins: int = 30, high: float = 100.0, low: float = 10.0
) -> tuple[float, ...]:
    """A burst of ``high`` for 2 min every 5 min (30 bins of 10 s), ``periods`` periods long."""
    n = round(periods * period_bins)
    return tuple(high if i % period_bins < high_bins else low for i in range(n))


def test_period_found_once_the_repeat_covers_half_a_period() -> None:
    # 45 bins = 1.5 periods: lag 30 is judged on 15 bins, an exact repeat of the first 15.
    period, corr = find_period(square(1.5), S)
    assert period == 30
    assert corr > 0.9
    # 40 bins: lag 30 would be judged on 10 bins < 15 (half a period): not yet.
    assert find_period(square(40 / 30), S)[0] is None


@pytest.mark.parametrize(
    "values",
    [
        tuple(float(i) for i in range(120)),  # a ramp: its autocorrelation only falls
        tuple(50.0 + (i % 2) for i in range(120)),  # flat (CV 1%): below min_variation
        tuple(100.0 if i < 12 else 10.0 for i in range(60)),  # one burst, never repeated
    ],
    ids=["ramp", "flat", "single-burst"],
)
def test_no_period_without_a_repeat(values: tuple[float, ...]) -> None:
    assert find_period(values, S)[0] is None


def test_forecast_is_the_load_one_period_earlier() -> None:
    # Feed one sample per 10 s bin from t = 0: bin k holds square(2)[k]. After t = 590 (bin 59 open,
    # bins 0..58 closed) the period is 30 bins = 300 s.
    state = None
    for k, value in enumerate(square(2)):
        state = seasonal_update(state, value, k * 10.0, S)
    assert state is not None and state.period_s(S) == 300.0
    # At t = 590, 30 s ahead over 60 s: [620, 680) one period earlier is [320, 380) = bins 32..37,
    # all in the burst (bins 30..41): 100.
    assert seasonal_forecast(state, 590.0, 30.0, 60.0, S) == 100.0
    # At t = 480: [510, 570) -> bins 21..26, all low: 10.
    assert seasonal_forecast(state, 480.0, 30.0, 60.0, S) == 10.0
    # At t = 550: [580, 640) -> bins 28..33: two low, four high: (2 x 10 + 4 x 100) / 6 = 70.
    assert seasonal_forecast(state, 550.0, 30.0, 60.0, S) == pytest.approx(70.0)


def test_no_forecast_without_a_period_and_bounded_memory() -> None:
    small = SeasonalSettings(max_bins=20)
    state = None
    for k in range(100):
        state = seasonal_update(state, 5.0, k * 10.0, small)
    assert state is not None
    assert len(state.bins) == 20
    assert seasonal_forecast(state, 990.0, 30.0, 60.0, small) is None


def test_seasonal_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="min_period_s"):
        SeasonalSettings(bin_s=10.0, min_period_s=10.0)
