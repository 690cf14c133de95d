"""Static checks of the dashboard and the alert rules; test_promql_live.py evaluates them for real."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .monitoring import DASHBOARD, alerts, dashboard_queries, recording_rules, rule_groups

ISSUE_PANELS = (
    "Replicas: desired vs ready",
    "Scale events by reason",
    "Queue depth",
    "Requests/s by code",
    "Time to first token p50 / p90 / p99: router (end to end) vs engine",
    "Inter-token latency p50 / p90 / p99 (engine)",
    "Prefix-cache hit rate",
    "KV-cache utilization per replica",
    "Cold start by phase",
    "GPU utilization (DCGM)",
)


def test_dashboard_has_every_panel_the_issue_lists() -> None:
    titles = [p["title"] for p in DASHBOARD["panels"] if p["type"] != "row"]
    assert set(ISSUE_PANELS) <= set(titles)
    assert len(titles) == len(set(titles))


def test_dashboard_is_portable() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in DASHBOARD["panels"]:
        if panel["type"] == "row":
            continue
        # Every panel uses the datasource variable, never a UID from someone's Grafana.
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


def test_ttft_panel_puts_router_beside_engine_for_each_quantile() -> None:
    (panel,) = [p for p in DASHBOARD["panels"] if p["title"].startswith("Time to first token")]
    exprs = [t["expr"] for t in panel["targets"]]
    for q in ("0.5", "0.9", "0.99"):
        assert any(f"histogram_quantile({q}," in e and "kvfleet_router_ttft_seconds_bucket" in e for e in exprs)
        assert any(f"histogram_quantile({q}," in e and "vllm:time_to_first_token_seconds_bucket" in e for e in exprs)


def test_every_dashboard_query_filters_by_model_or_says_why_not() -> None:
    # The launcher's and DCGM's series carry no model label (they are per pod).
    per_pod = {"Cold start by phase", "GPU utilization (DCGM)"}
    for query in dashboard_queries(model_regex="MODEL"):
        if query.panel not in per_pod:
            assert '=~"MODEL"' in query.expr, query


# Alerts on whether a component runs at all read Prometheus's `up` and kube-state-metrics
# directly: a recording rule cannot carry `absent`, and they must not depend on kvfleet's series.
HEALTH_ALERTS = {
    "KvfleetRouterDown",
    "KvfleetAutoscalerDown",
    "KvfleetOperatorDown",
    "KvfleetComponentInstanceDown",
    "KvfleetEngineCrashLooping",
    "KvfleetEnginePullFailing",
}


def test_alerts_compare_recorded_signals_with_thresholds() -> None:
    groups = rule_groups()
    records = recording_rules(groups)
    for name, expr in alerts(groups).items():
        used = set(re.findall(r"kvfleet:[a-z0-9_]+:[a-z0-9_]+", expr))
        if name in HEALTH_ALERTS:
            assert not used and not re.search(r"\bkvfleet_", expr), f"{name} must not read kvfleet's own series"
            continue
        assert used and used <= set(records), f"{name} must compare recording rules, found {used}"
    assert set(alerts(groups)) == {
        "KvfleetDeploymentNotReady",
        "KvfleetQueueGrowingAtMaxReplicas",
        "KvfleetColdStartOverBudget",
        "KvfleetTTFTSLOBurnFast",
        "KvfleetTTFTSLOBurnSlow",
        "KvfleetAutoscalerMetricsStale",
        "KvfleetRouter5xxRatio",
        "KvfleetKVCacheSaturated",
        *HEALTH_ALERTS,
    }


def test_recording_rules_aggregate_by_namespace_as_well_as_model() -> None:
    records = recording_rules(rule_groups())
    per_namespace = {name for name, expr in records.items() if re.search(r"by \(namespace\)", expr)}
    per_deployment = {name for name, expr in records.items() if re.search(r"by \(namespace, model\)", expr)}
    assert {
        "kvfleet:engine_requests_waiting:sum_by_namespace",
        "kvfleet:kv_cache_usage:avg_by_namespace",
    } <= per_namespace
    assert {"kvfleet:engine_requests_waiting:sum", "kvfleet:kv_cache_usage:avg"} <= per_deployment


def test_component_monitors_set_the_job_the_down_alerts_select() -> None:
    from .conftest import objects, render

    monitors = [
        d
        for d in objects(render({"monitoring": {"serviceMonitors": {"enabled": True}}}))
        if d["kind"] == "ServiceMonitor"
    ]
    jobs = {m["spec"]["endpoints"][0]["relabelings"][0]["replacement"] for m in monitors}
    assert jobs == {"kvfleet-router", "kvfleet-autoscaler"}
    exprs = alerts(rule_groups())
    for job in jobs:
        name = f"Kvfleet{job.removeprefix('kvfleet-').title()}Down"
        assert f'up{{job="{job}"}}' in exprs[name]


def test_thresholds_follow_the_values() -> None:
    groups = rule_groups({"ttftSloSeconds": 0.5, "ttftSloObjective": 0.95, "router5xxRatio": 0.2})
    exprs = alerts(groups)
    assert "> 0.72" in exprs["KvfleetTTFTSLOBurnFast"]  # 14.4 x 5% budget
    assert "> 0.3" in exprs["KvfleetTTFTSLOBurnSlow"]  # 6 x 5%
    assert "> 0.2" in exprs["KvfleetRouter5xxRatio"]
    assert 'le=~"0.5|0.5.0"' in recording_rules(groups)["kvfleet:router_ttft_slo_miss_ratio:rate5m"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with the Debian prometheus package")
def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    path = tmp_path / "kvfleet.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
