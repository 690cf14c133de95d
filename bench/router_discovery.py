"""Benchmark: event-loop time the router's Kubernetes discovery spends per watch event, before and after.

Before, every InferenceDeployment or EndpointSlice event rebuilt the whole snapshot and validated
every deployment's spec again (``build_snapshot``, still the pure reference of what the snapshot
is). After, the source validates only the changed deployment (``served_deployment``) and assembles
the snapshot from cached per-deployment views (``assemble``). Both run here in the same process on the same
objects (the spec bench/apiserver_load.py creates, one ready endpoint each); medians of repeated
runs, on the event loop's thread, as the router pays them.

    .venv/bin/python bench/router_discovery.py [--deployments 1 200 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfleet.router.kubernetes_source import (
    assemble,
    build_snapshot,
    merge_endpoints,
    served_deployment,
    slice_endpoints,
    view_of,
)

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def deployment(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"m{i:04d}", "namespace": "load", "resourceVersion": str(i + 1)},
        "spec": {
            "model": {"uri": f"s3://model-cache/models/m{i:04d}"},
            "engine": {"kind": "vllm"},
            "resources": {"gpus": 1},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 4},
            "cache": {"bucket": "model-cache"},
        },
    }


def endpoint_slice(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"m{i:04d}-x", "namespace": "load", "labels": {"kvfleet.io/deployment": f"m{i:04d}"}},
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [f"10.{i // 250}.{i % 250}.1"], "conditions": {"ready": True}}],
    }


def median_s(fn: Callable[[], object], budget_s: float = 1.0, max_runs: int = 2000) -> float:
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < max_runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(n: int) -> dict[str, Any]:
    deployments = {("load", f"m{i:04d}"): deployment(i) for i in range(n)}
    slices = {("load", f"m{i:04d}-x"): endpoint_slice(i) for i in range(n)}
    served = {k: one for k, v in deployments.items() if (one := served_deployment(k, v)) is not None}
    endpoints = {
        ("load", f"m{i:04d}"): merge_endpoints({("load", "s"): slice_endpoints(slices[("load", f"m{i:04d}-x")])})
        for i in range(n)
    }
    changed_key = ("load", f"m{n // 2:04d}")
    changed = deployments[changed_key]

    views = {key: view_of(key, one, endpoints.get(key, ())) for key, one in served.items()}

    def after() -> None:
        one = served_deployment(changed_key, changed)
        assert one is not None
        views[changed_key] = view_of(changed_key, one, endpoints.get(changed_key, ()))
        assemble(views)

    before_s = median_s(lambda: build_snapshot(deployments, slices))
    after_s = median_s(after)
    return {
        "deployments": n,
        "before_ms": round(before_s * 1e3, 3),
        "after_ms": round(after_s * 1e3, 3),
        "ratio": round(before_s / after_s, 1),
        "validations_per_event": {"before": n, "after": 1},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deployments", type=int, nargs="+", default=[1, 200, 2000])
    args = parser.parse_args()
    runs = [measure(n) for n in args.deployments]
    for run in runs:
        print(json.dumps(run))
    (OUT / "router_discovery.json").write_text(json.dumps(runs, indent=2) + "\n")
    lines = [
        "# Router discovery: event-loop time per watch event",
        "",
        "One InferenceDeployment event with N deployments known (each with one ready endpoint), on the",
        "router's event-loop thread. Before: the whole snapshot rebuilt and every spec validated again",
        "(`build_snapshot`). After: the changed spec validated, its view rebuilt, the snapshot assembled",
        "from cached views.",
        "Medians in one process; 2 shared cores. Command: `.venv/bin/python bench/router_discovery.py`.",
        "",
        "| deployments | before | after | before / after | specs validated per event (before / after) |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['deployments']} | {r['before_ms']} ms | {r['after_ms']} ms | {r['ratio']}x | "
            f"{r['validations_per_event']['before']} / {r['validations_per_event']['after']} |"
        )
    lines += [
        "",
        "A burst of events (a relist, a rollout) is one assembled snapshot after, one per event before.",
    ]
    (OUT / "router_discovery.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
