"""The chart's PromQL, as data: the dashboard's panel queries and the PrometheusRule's rules.

Shared by the static tests and by the live test against a real Prometheus.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .conftest import CHART, objects, render

DASHBOARD = json.loads((CHART / "dashboards" / "kvfleet.json").read_text())


@dataclass(frozen=True)
class Query:
    panel: str
    legend: str
    expr: str
    ref_id: str = "A"


def dashboard_queries(model_regex: str = ".+", rate_interval: str = "1m") -> list[Query]:
    """Every panel target, with Grafana's variables replaced as Grafana would replace them."""
    found = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate_interval).replace("$model", model_regex)
            found.append(Query(panel["title"], target.get("legendFormat", ""), expr, target["refId"]))
    return found


def rule_groups(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The PrometheusRule's groups, rendered with the alerts enabled."""
    merged: dict[str, Any] = {"monitoring": {"prometheusRule": {"enabled": True}}}
    if values:
        merged["monitoring"]["prometheusRule"].update(values)
    (rule,) = [d for d in objects(render(merged)) if d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def recording_rules(groups: list[dict[str, Any]]) -> dict[str, str]:
    return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}


def alerts(groups: list[dict[str, Any]]) -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"] if "alert" in r}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (names followed by a selector, range or space)."""
    names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr))
    return {n for n in names if n not in {"by", "without", "on", "ignoring", "group_left", "group_right"}}
