"""The dashboard's and the alert rules' PromQL, evaluated by a real Prometheus on real kvfleet data.

`test_harness_*` checks the machinery (the Debian Prometheus, range queries, the PNG renderer) on
Prometheus's own metrics. `test_every_expression_returns_data` starts the real components as
processes: two reference engines on a tiny random model, the router in front of them, a second
router that discovers deployments from a Kubernetes API (KMock), and the autoscaler deciding from
that Prometheus for the deployments it watches in the same API. Prometheus scrapes them all every
second with the chart's rules loaded; the test drives traffic and asserts that every dashboard
query, recording rule and alert expression returns data. The few that cannot have data here are
listed in NO_DATA with the reason; the test fails if one of them starts returning data (the list
must stay true) or if any other returns none.

The fleet stages what each alert watches, with real processes: a deployment with no replica
(requests held in the second router's queue while the deployment is at maxReplicas), a replica that
accepts connections and never answers (a 504 after the router's read timeout), a second autoscaler
whose metric source (a Prometheus URL) refuses connections (it holds its deployment: metrics stale),
and a TTFT objective below what the tiny model achieves (the burn-rate alerts). Alerts are evaluated
as expressions; their `for:` durations are Prometheus's business and are not waited out.

`KVFLEET_WRITE_PNGS=1` writes each panel's picture to docs/dashboard/ (otherwise to a temp dir).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import socket
import struct
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import click
import pytest
import yaml

from kvfleet.cli import cli

from .conftest import REPO_ROOT
from .live import Prometheus, plot_panel, run_prometheus, slug
from .monitoring import DASHBOARD, Query, alerts, dashboard_queries, metric_names, recording_rules, rule_groups
from .stack import Process, dead_port, hold_request, hung_listener, kubernetes_api, start, stopping, wait_healthy

pytestmark = pytest.mark.slow
PNG_DIR = REPO_ROOT / "docs" / "dashboard"
SERVED = "tiny-chat"  # two engines
COLD = "tiny-cold"  # no replica (a second router discovers it in Kubernetes): requests are held, the queue grows
HUNG = "tiny-hung"  # one replica that never answers: a 504 after the router's read timeout, no retry
STALE = "tiny-stale"  # scaled by an autoscaler whose metric source refuses connections: a stale hold
STALE_NAMESPACE = "team-stale"  # the stale autoscaler watches only this namespace, the other one only default
RATE_INTERVAL = "15s"  # Grafana's $__rate_interval for a 1 s scrape and short steps: 4 x scrape, rounded up
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
SYSTEM = "You are the support assistant of a hardware shop. Answer in two short sentences. " * 4
# The tiny CPU model's first token comes within milliseconds through the router: an objective of
# 5 ms (the router's lowest TTFT bucket) gives the burn-rate rules something to burn.
# A 1 s cold-start budget: the launcher's real start of the tiny model (torch's import alone) is longer.
RULE_VALUES = {
    "ttftSloSeconds": 0.005,
    "ttftSloObjective": 0.99,
    "router5xxRatio": 0.05,
    "coldStartBudgetSeconds": 1,
    # Any KV use counts as saturated: the tiny engines never fill their cache.
    "kvCacheSaturationRatio": 0.0001,
}

KSM = "no kube-state-metrics here; test_alerts_promtool.py proves it fires on its series"
NO_DATA = {
    "panel GPU utilization (DCGM) / A": "no GPU and no DCGM exporter here: DCGM_FI_DEV_GPU_UTIL never exists",
    "alert KvfleetOperatorDown": KSM,
    "alert KvfleetEngineCrashLooping": KSM,
    "alert KvfleetEnginePullFailing": KSM,
}
# A second installation (another release namespace) whose router and autoscaler are both down:
# targets that refuse connections, scraped under the chart's job names.
DOWN_NAMESPACE = "kvfleet-down"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_harness_evaluates_range_queries_and_draws_panels(tmp_path: Path, free_port: int) -> None:
    port = free_port
    scrape = [{"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]
    with run_prometheus(tmp_path / "prom", port, scrape) as prometheus:
        start_s = time.time()
        assert prometheus.wait_for('up{job="prometheus"} == 1', timeout_s=60)
        # Several samples, so that the range query's steps (aligned on its start) land after one.
        assert prometheus.wait_for("count_over_time(prometheus_tsdb_head_series[1m]) >= 3", timeout_s=30)
        query = Query("Head series", "{{job}}", "sum by (job) (prometheus_tsdb_head_series)")
        out = tmp_path / "panel.png"
        assert plot_panel(prometheus, "Head series", [query], start_s - 5, time.time(), out) == 1
        assert png_size(out) == (800, 320)
        empty = tmp_path / "empty.png"
        nothing = [Query("x", "", "absent_metric_name")]
        assert plot_panel(prometheus, "Nothing", nothing, start_s, time.time(), empty) == 0


@dataclass(frozen=True)
class Expression:
    key: str
    expr: str


def every_expression(groups: list[dict[str, Any]]) -> list[Expression]:
    found = [Expression(f"panel {q.panel} / {q.ref_id}", q.expr) for q in dashboard_queries(".+", RATE_INTERVAL)]
    found += [Expression(f"record {name}", expr) for name, expr in recording_rules(groups).items()]
    found += [Expression(f"alert {name}", expr) for name, expr in alerts(groups).items()]
    return found


def finite_points(prometheus: Prometheus, expr: str, start_s: float, end_s: float) -> int:
    series = prometheus.series(expr, start_s, end_s, step_s=1.0)
    return sum(1 for s in series for _, v in s["values"] if math.isfinite(float(v)))


def explain(prometheus: Prometheus, expr: str) -> dict[str, str]:
    """The range of each series an empty expression reads, over the run (for the failure message)."""
    found = {}
    for name in sorted(metric_names(expr) | set(re.findall(r"\b(kvfleet:[a-z0-9_:]+)", expr))):
        lows = prometheus.instant(f"min_over_time({name}[5m])")
        highs = prometheus.instant(f"max_over_time({name}[5m])")
        found[name] = (
            "; ".join(
                f"{low['metric']}: {low['value'][1]}..{high['value'][1]}"
                for low, high in zip(lows, highs, strict=False)
            )
            or "no series"
        )
    return found


AUTOSCALING = {
    SERVED: {"minReplicas": 1, "maxReplicas": 2, "targetConcurrencyPerReplica": 2},
    COLD: {"minReplicas": 1, "maxReplicas": 1},
    STALE: {"minReplicas": 1, "maxReplicas": 3},
}


def autoscaled(name: str, namespace: str = "default") -> tuple[str, dict[str, object]]:
    """An InferenceDeployment for the autoscalers to scale, as (collection path, body) for KMock."""
    doc = yaml.safe_load((REPO_ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace, "uid": f"uid-{name}", "resourceVersion": "1"}
    doc["spec"]["model"]["servedName"] = name
    kept = {k: v for k, v in doc["spec"]["autoscaling"].items() if k != "scaleToZeroAfterSeconds"}
    doc["spec"]["autoscaling"] = {**kept, **AUTOSCALING[name]}
    return f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/inferencedeployments", doc


def kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig for the emulator: its URL and no credentials."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
        "current-context": "kmock",
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def drive_traffic(
    router_url: str, cold_router_url: str, duration_s: float, held: list[socket.socket]
) -> dict[str, int]:
    """Chat traffic (streamed and not, a shared system prompt), 5xx from the hung replica, and one
    more held request for the cold deployment every second. Returns the status codes seen."""
    codes: dict[str, int] = {}
    deadline = time.monotonic() + duration_s

    async def one(session: aiohttp.ClientSession, model: str, i: int, stream: bool) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: which drill?"}]
        body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": stream}
        async with session.post(router_url + "/v1/chat/completions", json=body) as response:
            await response.read()
            codes[f"{model} {response.status}"] = codes.get(f"{model} {response.status}", 0) + 1

    async def chat_worker(session: aiohttp.ClientSession, worker: int) -> None:
        i = worker
        while time.monotonic() < deadline:
            await one(session, SERVED, i, stream=i % 2 == 0)
            i += 3
            await asyncio.sleep(0.1)  # a few dozen requests/s: enough for every rate, gentle on 2 cores

    async def hung_waves(session: aiohttp.ClientSession) -> None:
        # Waves of three: the 5xx counter must grow after its series appears for rate() to see it.
        while time.monotonic() < deadline:
            await asyncio.gather(*(one(session, HUNG, i, stream=False) for i in range(3)))

    async def hold_cold() -> None:
        while time.monotonic() < deadline:
            held.append(await asyncio.to_thread(hold_request, cold_router_url, COLD))
            await asyncio.sleep(1.0)

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(
            *(chat_worker(session, w) for w in range(3)),
            hung_waves(session),
            hold_cold(),
        )
    return codes


def kv_cache_use_recorded(router_url: str, prometheus: Prometheus, threshold: float, timeout_s: float) -> bool:
    """Hold the engines' KV cache until Prometheus has recorded it in use above ``threshold``.

    The KV-cache alert's expression (``kvfleet:kv_cache_usage:avg > threshold``) has data only where
    a rule evaluation read a scrape taken while a sequence held blocks: the engine's gauge is back to
    0 when its last sequence ends. The traffic's 8-token answers last milliseconds, and all of them
    can fall between the 1 s scrapes, the more so when a loaded machine runs the scrapes late. So
    decode long answers (ignore_eos: each holds its blocks over several scrapes) until the recorded
    series shows it, bounded, instead of hoping a scrape landed mid-request."""
    expr = f"max_over_time(kvfleet:kv_cache_usage:avg[5m]) > {threshold}"
    deadline = time.monotonic() + timeout_s
    body = {"model": SERVED, "max_tokens": 512, "ignore_eos": True, "temperature": 0}
    body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me everything."}]
    while not prometheus.instant(expr):
        if time.monotonic() > deadline:
            return False
        request = urllib.request.Request(
            router_url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
    return True


def launcher_merged() -> bool:
    engine = cli.get_command(click.Context(cli), "engine")
    return isinstance(engine, click.Group) and "launch" in engine.list_commands(click.Context(engine))


def cold_deployment() -> tuple[str, dict[str, object]]:
    """The InferenceDeployment the second router discovers: no EndpointSlice, so no replica."""
    path, body = autoscaled(COLD)
    spec = body["spec"]
    assert isinstance(spec, dict)
    spec["routing"] = {**spec["routing"], "maxQueueWaitSeconds": 300}
    return path, body


def test_every_expression_returns_data(tmp_path: Path) -> None:
    assert launcher_merged(), "the launcher (kvfleet engine launch) exports the cold-start metrics this test needs"
    png_dir = PNG_DIR if os.environ.get("KVFLEET_WRITE_PNGS") == "1" else tmp_path / "pngs"
    logs = tmp_path / "logs"
    logs.mkdir()
    groups = rule_groups(RULE_VALUES)
    names = ["prometheus", "kube", "router", "router-cold", "autoscaler", "autoscaler-stale", "e0", "e1", "launcher"]
    ports = {name: dead_port() for name in [*names, "refused"]}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    model_dir = tmp_path / "tiny"
    router_settings = tmp_path / "router.yaml"
    # 4 s without a byte is a hung replica here (the tiny model's whole answer takes milliseconds).
    router_settings.write_text(yaml.safe_dump({"idle_read_timeout_s": 4.0, "connect_timeout_s": 1.0}))
    # The chart's ServiceMonitors name the router's and the autoscaler's jobs (the down alerts select them).
    jobs = {
        "engine": ["e0", "e1"],
        "kvfleet-router": ["router", "router-cold"],
        "kvfleet-autoscaler": ["autoscaler", "autoscaler-stale"],
        "launcher": ["launcher"],
    }
    scrape = [
        {"job_name": job, "static_configs": [{"targets": [url[t].removeprefix("http://") for t in targets]}]}
        for job, targets in jobs.items()
    ]
    for config in scrape:
        if config["job_name"].startswith("kvfleet-"):
            # The chart's ServiceMonitors: the pods' namespace as a target label, and honorLabels so the
            # router's and the autoscaler's per-model `namespace` (the deployment's) wins over it.
            config["honor_labels"] = True
            config["static_configs"][0]["labels"] = {"namespace": "kvfleet-system"}
            down = {"targets": [f"127.0.0.1:{dead_port()}"], "labels": {"namespace": DOWN_NAMESPACE}}
            config["static_configs"].append(down)
        else:
            # The operator's ServiceMonitor for a deployment's engines lives in its namespace.
            config["static_configs"][0]["labels"] = {"namespace": "default"}
    held: list[socket.socket] = []
    with (
        hung_listener() as hung_port,
        kubernetes_api(
            ports["kube"], [cold_deployment(), autoscaled(SERVED), autoscaled(STALE, STALE_NAMESPACE)]
        ) as kube_url,
        stopping([]) as processes,
        run_prometheus(tmp_path / "prom", ports["prometheus"], scrape, groups) as prometheus,
    ):
        replicas = [f"--replica={SERVED}={url[e]}" for e in ("e0", "e1")]
        replicas.append(f"--replica={HUNG}=http://127.0.0.1:{hung_port}")
        # A crashed replica of the served model, listed first so the first pick (a tie, broken by
        # replica id) goes to it: the refused connection is retried on a live replica.
        replicas.insert(0, f"--replica={SERVED}={url['refused']}")
        wake, refused, settings = f"--autoscaler-url={url['autoscaler']}", url["refused"], router_settings
        # The autoscalers in their production mode: deployments watched in the API, status patched there.
        kube = ["--kubeconfig", str(kubeconfig(tmp_path / "kubeconfig", kube_url)), "--no-leader-election"]
        scale = ["autoscaler", "run", *kube, "--listen-host=127.0.0.1", "--tick-interval-s=1"]
        commands = {
            "router": ["router", "serve", f"--port={ports['router']}", f"--settings={settings}", *replicas, wake],
            # A second router replica, in its production mode: discovery from the Kubernetes API.
            "router-cold": [
                *("router", "serve", f"--port={ports['router-cold']}", wake),
                *("--kubernetes", f"--kube-server={kube_url}", "--namespace=default"),
            ],
            "autoscaler": [
                *(*scale, f"--listen-port={ports['autoscaler']}", "--namespace=default"),
                f"--prometheus-url={url['prometheus']}",
            ],
            # Its metric source (a Prometheus URL) refuses connections: it holds its deployment, stale.
            "autoscaler-stale": [
                *(*scale, f"--listen-port={ports['autoscaler-stale']}", f"--namespace={STALE_NAMESPACE}"),
                f"--prometheus-url={refused}",
            ],
        }
        make = start("make-tiny-model", ["engine", "make-tiny-model", str(model_dir)], "", logs)
        processes.append(make)
        processes += [start(name, args, url[name], logs) for name, args in commands.items()]
        assert make.proc.wait(timeout=120) == 0, make.tail()
        engine = ["engine", "serve", f"--model={model_dir}", "--host=127.0.0.1", f"--served-model-name={SERVED}"]
        engine += ["--threads=1", "--kv-blocks=256", "--block-size=16"]
        processes.append(start("e0", [*engine, f"--port={ports['e0']}"], url["e0"], logs))
        # e1 runs as it does in a pod: the launcher starts the engine and exports the cold start.
        spec = {
            "name": SERVED,
            "namespace": "default",
            "servedName": SERVED,
            "spec": {
                "model": {"uri": f"file://{model_dir}"},
                "engine": {"kind": "reference"},
                "resources": {"gpus": 0},
            },
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        launch = ["engine", "launch", f"--spec={tmp_path / 'spec.json'}", f"--node-cache-dir={tmp_path / 'node'}"]
        launch += [f"--engine-port={ports['e1']}", "--metrics-host=127.0.0.1", f"--metrics-port={ports['launcher']}"]
        e1 = start("e1", launch, url["e1"], logs)
        processes.append(e1)
        health = [(p, "/healthz" if p.name.startswith("autoscaler") else "/health") for p in processes[1:]]
        # /coldstart answers 200 once every phase, the first served token included, is measured.
        health.append((Process("launcher", url["launcher"], e1.proc, e1.log), "/coldstart"))
        wait_healthy(health, timeout_s=180)
        # Only the second installation's components are down; this one's are all up.
        assert prometheus.wait_for(f'up{{namespace="{DOWN_NAMESPACE}"}} == 0', timeout_s=30)
        assert prometheus.wait_for(f"count(up == 1) == {sum(len(t) for t in jobs.values())}", timeout_s=30)
        # The second router has listed the cold deployment (its queue gauge starts at 0).
        assert prometheus.wait_for(f'kvfleet_router_queue_depth{{model="{COLD}"}}', timeout_s=30)

        start_s = time.time()
        try:
            codes = asyncio.run(drive_traffic(url["router"], url["router-cold"], 25.0, held))
            assert codes.get(f"{SERVED} 200", 0) >= 10, codes
            # The hung replica times out: the router answers 504 without a retry (it may still be working).
            assert sum(n for k, n in codes.items() if k.startswith(f"{HUNG} 5")) >= 6, codes
            threshold = RULE_VALUES["kvCacheSaturationRatio"]
            assert kv_cache_use_recorded(url["router"], prometheus, threshold, 60), "no scrape saw the KV cache in use"

            expressions = every_expression(groups)
            assert len({e.key for e in expressions}) == len(expressions)
            assert set(NO_DATA) <= {e.key for e in expressions}, "NO_DATA names an expression that is gone"
            # Recording rules and rates need a few more evaluations after the traffic: poll, bounded.
            deadline = time.monotonic() + 45
            while True:
                end_s = time.time()
                empty = {e.key for e in expressions if not finite_points(prometheus, e.expr, start_s - 10, end_s)}
                if empty == set(NO_DATA) or time.monotonic() > deadline:
                    break
                time.sleep(2)
            missing = {e.key: explain(prometheus, e.expr) for e in expressions if e.key in empty - set(NO_DATA)}
            assert not missing, f"no data for: {json.dumps(missing, indent=1)}"
            assert set(NO_DATA) - empty == set(), f"listed in NO_DATA but has data now: {sorted(set(NO_DATA) - empty)}"
            # The down alerts name the installation that is down, and only it; `absent` covers a
            # component Prometheus finds nothing of at all.
            exprs = alerts(groups)
            for name in ("KvfleetRouterDown", "KvfleetAutoscalerDown"):
                assert {r["metric"].get("namespace") for r in prometheus.instant(exprs[name])} == {DOWN_NAMESPACE}
                nothing = exprs[name].replace('job="kvfleet-', 'job="kvfleet-none-')
                (absent,) = prometheus.instant(nothing)
                assert absent["metric"]["job"].startswith("kvfleet-none-")
            down = {r["metric"]["namespace"] for r in prometheus.instant(exprs["KvfleetComponentInstanceDown"])}
            assert down == {DOWN_NAMESPACE}

            by_panel: dict[str, list[Query]] = {}
            for query in dashboard_queries(".+", RATE_INTERVAL):
                by_panel.setdefault(query.panel, []).append(query)
            units = {p["title"]: p.get("fieldConfig", {}).get("defaults", {}).get("unit", "") for p in PANELS}
            for title, queries in by_panel.items():
                out = png_dir / f"{slug(title)}.png"
                reasons = {NO_DATA.get(f"panel {title} / {q.ref_id}") for q in queries}
                note = "; ".join(sorted(r for r in reasons if r))
                drawn = plot_panel(
                    prometheus, title, queries, start_s - 10, end_s, out, units[title], start_s, no_data_note=note
                )
                expected_empty = None not in reasons
                assert (drawn == 0) == expected_empty, title
                assert png_size(out)[0] > 0
        finally:
            for sock in held:
                sock.close()
