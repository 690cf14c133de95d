"""The health and saturation alerts fire, and stay quiet, as specified: Prometheus's own rule
unit tester (`promtool test rules`) evaluates the chart's rendered rules over input series, with
their `for:` durations. The alerts that read kube-state-metrics (operator availability, engine
crash loops and image pulls) are proven here only: no kube-state-metrics runs on this machine.
The live test (test_promql_live.py) makes the `up`-based and KV alerts fire on real processes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .monitoring import rule_groups

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool comes with the Debian prometheus package"
)
NS = "kvfleet-system"
OPERATOR = f'kube_deployment_status_replicas_available{{namespace="{NS}", deployment="kvf-kvfleet-operator"}}'


def fires(at: str, alert: str, *expected: dict[str, str]) -> dict[str, Any]:
    """An alert_rule_test: at ``at``, ``alert`` is firing with exactly these label sets (none: quiet)."""
    return {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": labels} for labels in expected]}


CASES: dict[str, tuple[list[dict[str, str]], list[dict[str, Any]]]] = {
    # Both routers stop answering at minute 2: pending for 5 minutes, then firing; the autoscaler
    # was never scraped at all (absent).
    "every router down, autoscaler never scraped": (
        [
            {"series": f'up{{job="kvfleet-router", namespace="{NS}", instance="r1"}}', "values": "1 1 0x12"},
            {"series": f'up{{job="kvfleet-router", namespace="{NS}", instance="r2"}}', "values": "1 1 0x12"},
        ],
        [
            fires("5m", "KvfleetRouterDown"),
            fires("8m", "KvfleetRouterDown", {"severity": "critical", "namespace": NS}),
            fires("8m", "KvfleetAutoscalerDown", {"severity": "critical", "job": "kvfleet-autoscaler"}),
            fires(
                "8m",
                "KvfleetComponentInstanceDown",
                {"severity": "warning", "job": "kvfleet-router", "namespace": NS, "instance": "r1"},
                {"severity": "warning", "job": "kvfleet-router", "namespace": NS, "instance": "r2"},
            ),
        ],
    ),
    "one router of two down": (
        [
            {"series": f'up{{job="kvfleet-router", namespace="{NS}", instance="r1"}}', "values": "1x12"},
            {"series": f'up{{job="kvfleet-router", namespace="{NS}", instance="r2"}}', "values": "1 0x12"},
            {"series": f'up{{job="kvfleet-autoscaler", namespace="{NS}", instance="a1"}}', "values": "1x12"},
        ],
        [
            fires("8m", "KvfleetRouterDown"),
            fires("8m", "KvfleetAutoscalerDown"),
            fires(
                "8m",
                "KvfleetComponentInstanceDown",
                {"severity": "warning", "job": "kvfleet-router", "namespace": NS, "instance": "r2"},
            ),
        ],
    ),
    "operator without an available replica": (
        [{"series": OPERATOR, "values": "1 1 0x12"}],
        [
            fires("4m", "KvfleetOperatorDown"),
            fires(
                "8m",
                "KvfleetOperatorDown",
                {"severity": "critical", "namespace": NS, "deployment": "kvf-kvfleet-operator"},
            ),
        ],
    ),
    "operator deployment gone while kube-state-metrics runs": (
        [{"series": 'kube_deployment_status_replicas_available{namespace="other", deployment="x"}', "values": "1x12"}],
        [
            fires(
                "8m",
                "KvfleetOperatorDown",
                {"severity": "critical", "namespace": NS, "deployment": "kvf-kvfleet-operator"},
            )
        ],
    ),
    "no kube-state-metrics at all: no operator alarm": (
        [{"series": f'up{{job="kvfleet-router", namespace="{NS}", instance="r1"}}', "values": "1x12"}],
        [fires("8m", "KvfleetOperatorDown")],
    ),
    "an engine crash looping, another pulling its image in vain": (
        [
            {
                # kube-state-metrics reports the waiting reason between restarts (1) and 0 while it runs.
                "series": 'kube_pod_container_status_waiting_reason{namespace="team-a", pod="llama-0", '
                'container="engine", reason="CrashLoopBackOff"}',
                "values": "0 1 0 1 1 0 1 1 1 0 1 1 1",
            },
            {
                "series": 'kube_pod_container_status_waiting_reason{namespace="team-a", pod="qwen-0", '
                'container="engine", reason="ImagePullBackOff"}',
                "values": "0 1x12",
            },
            {
                # Another workload's container crash looping: not kvfleet's business.
                "series": 'kube_pod_container_status_waiting_reason{namespace="team-a", pod="web-0", '
                'container="nginx", reason="CrashLoopBackOff"}',
                "values": "1x12",
            },
        ],
        [
            fires("3m", "KvfleetEngineCrashLooping"),
            fires("8m", "KvfleetEngineCrashLooping", {"severity": "critical", "namespace": "team-a", "pod": "llama-0"}),
            fires("8m", "KvfleetEnginePullFailing", {"severity": "critical", "namespace": "team-a", "pod": "qwen-0"}),
        ],
    ),
    "KV cache saturated for one deployment": (
        [
            {
                "series": 'vllm:kv_cache_usage_perc{namespace="team-a", model_name="llama", pod="llama-0"}',
                "values": "0.5 0.99x15",
            },
            {
                "series": 'vllm:kv_cache_usage_perc{namespace="team-a", model_name="llama", pod="llama-1"}',
                "values": "0.5 0.97x15",
            },
            {
                "series": 'vllm:kv_cache_usage_perc{namespace="team-b", model_name="qwen", pod="qwen-0"}',
                "values": "0.6x15",
            },
        ],
        [
            fires("9m", "KvfleetKVCacheSaturated"),
            fires("12m", "KvfleetKVCacheSaturated", {"severity": "warning", "namespace": "team-a", "model": "llama"}),
        ],
    ),
    # team-a's llama serves; team-b's deployment of the same served name has no engine. Joined by
    # model alone, team-a's engines would hide team-b's outage.
    "one namespace's engines do not hide another's outage of the same served name": (
        [
            {"series": 'kvfleet_autoscaler_desired_replicas{namespace="team-a", model="llama"}', "values": "2x15"},
            {"series": 'kvfleet_autoscaler_desired_replicas{namespace="team-b", model="llama"}', "values": "1x15"},
            {
                "series": 'vllm:num_requests_running{namespace="team-a", model_name="llama", pod="llama-0"}',
                "values": "0x15",
            },
        ],
        [
            fires(
                "12m", "KvfleetDeploymentNotReady", {"severity": "critical", "namespace": "team-b", "model": "llama"}
            ),
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_alert_fires_as_specified(tmp_path: Path, case: str) -> None:
    series, checks = CASES[case]
    groups = rule_groups()
    # This promtool compares annotations exactly when an alert fires; the labels are what is
    # specified here (the annotation templates are checked by `promtool check rules`).
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    spec = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run(
        ["promtool", "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
