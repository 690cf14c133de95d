"""The launcher's choice between fetching an artifact and rebuilding: hand-checkable numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine_image.artifact_decision import (
    DecisionSettings,
    FetchRate,
    choose_rate,
    decide,
    measured_rate,
    read_node_rate,
    record_node_rate,
)

# No overhead, no margin, restoring costs nothing: the numbers below can be checked by hand.
PLAIN = DecisionSettings(fetch_overhead_s=0.0, safety_factor=1.0, hit_cost_fraction=0.0)
RATE_100 = FetchRate(100e6, "this launch's weight pull")


def test_used_when_the_fetch_is_shorter_than_the_build_it_replaces() -> None:
    decision = decide(200_000_000, 10.0, RATE_100, PLAIN)  # 2 s to fetch, 10 s saved
    assert decision.use and decision.expected_fetch_s == pytest.approx(2.0)
    assert "200.0 MB at 100 MB/s (this launch's weight pull)" in decision.reason and "used" in decision.reason


def test_not_used_when_rebuilding_is_faster() -> None:
    decision = decide(2_000_000_000, 10.0, RATE_100, PLAIN)  # 20 s to fetch a 10 s build
    assert not decision.use and "rebuilding is faster" in decision.reason


def test_margin_overhead_and_restore_cost_count_against_the_artifact() -> None:
    settings = DecisionSettings(fetch_overhead_s=1.0, safety_factor=2.0, hit_cost_fraction=0.5)
    # fetch 1 + 2 = 3 s, x2 = 6 s; saving 10 * 0.5 = 5 s: not worth it.
    assert not decide(200_000_000, 10.0, RATE_100, settings).use
    # fetch 1 + 1 = 2 s, x2 = 4 s < 5 s.
    assert decide(100_000_000, 10.0, RATE_100, settings).use


def test_an_artifact_without_a_build_time_is_used_and_says_so() -> None:
    decision = decide(1, None, RATE_100, PLAIN)
    assert decision.use and "records no build time" in decision.reason


def test_rate_comes_from_measurements_before_the_assumption(tmp_path: Path) -> None:
    assert measured_rate(1 << 20, 1.0, "x") is None  # too small to be a rate
    pulled = measured_rate(400 << 20, 2.0, "this launch's weight pull")
    assert pulled is not None and pulled.bytes_per_s == pytest.approx((400 << 20) / 2)
    assert choose_rate([None, pulled], PLAIN) is pulled
    assert choose_rate([None, None], PLAIN).source == "assumed"
    assert read_node_rate(tmp_path) is None
    record_node_rate(tmp_path, FetchRate(5e8, "node record"))
    node = read_node_rate(tmp_path)
    assert node is not None and node.bytes_per_s == 5e8 and node.source == "node record"
    (tmp_path / ".fetch-rate.json").write_text("{broken")
    assert read_node_rate(tmp_path) is None


def test_settings_are_bounded() -> None:
    with pytest.raises(ValueError, match="safety_factor"):
        DecisionSettings(safety_factor=0.5)
    with pytest.raises(ValueError, match="hit_cost_fraction"):
        DecisionSettings(hit_cost_fraction=1.0)
