"""Engine metrics for the view: parsing, per-replica deltas and PromQL-style quantiles."""

from __future__ import annotations

import math

import pytest

from kvfleet.autoscaler.engine_metrics import EngineSample, parse_engine_metrics
from kvfleet.autoscaler.scrape_source import histogram_quantile
from kvfleet.local.metrics import MetricWindow

EXPOSITION = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 2
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 3
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="tiny"} 100
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="tiny"} 40
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="tiny"} 7
vllm:request_success_total{finished_reason="length",model_name="tiny"} 3
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 4
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="tiny"} 10
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 10
vllm:time_to_first_token_seconds_count{model_name="tiny"} 10
vllm:time_to_first_token_seconds_sum{model_name="tiny"} 3.0
"""


def test_parse_sums_label_sets() -> None:
    sample = parse_engine_metrics(EXPOSITION)
    assert (sample.running, sample.waiting) == (2, 3)
    assert sample.requests_done == 10
    assert (sample.prefix_queries, sample.prefix_hits) == (100, 40)
    assert sample.ttft_buckets == {0.1: 4, 1.0: 10, math.inf: 10}
    # Scraped for one deployment, an engine's series of another served name are not its own.
    assert parse_engine_metrics(EXPOSITION, "tiny") == sample
    other = parse_engine_metrics(EXPOSITION, "other")
    assert (other.running, other.requests_done, other.ttft_buckets) == (None, 0.0, {})


def test_histogram_quantile_interpolates_like_promql() -> None:
    buckets = {0.1: 4.0, 1.0: 10.0, math.inf: 10.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.9 * (5 - 4) / 6)
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, {0.1: 0.0, math.inf: 5.0}) == 0.1  # in +Inf: highest finite bound
    assert histogram_quantile(0.5, {}) is None


def test_window_rates_survive_restarts_and_new_replicas() -> None:
    window = MetricWindow(window_s=10)
    window.observe(0.0, {"a": EngineSample(requests_done=10, prefix_queries=10, prefix_hits=5)})
    window.observe(2.0, {"a": EngineSample(requests_done=20, prefix_queries=20, prefix_hits=10)})
    # a restarted (counter went down), b is new: both count from zero.
    window.observe(
        4.0,
        {
            "a": EngineSample(requests_done=4, prefix_queries=10, prefix_hits=10),
            "b": EngineSample(requests_done=6, prefix_queries=10, prefix_hits=0, waiting=2),
        },
    )
    stats = window.stats()
    assert stats.requests_per_s == pytest.approx((10 + 10) / 4.0)
    assert stats.prefix_hit_rate == pytest.approx((5 + 5 + 10) / (10 + 10 + 20))
    assert stats.queue_depth == 2
    window.observe(20.0, {})
    assert window.stats().prefix_hit_rate is None  # everything older than the window is dropped
