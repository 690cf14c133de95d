"""Benchmark: the kept async Kubernetes clients for Python, side by side against a real API server.

Candidates for the single client the router and the autoscaler share: kubernetes_asyncio, lightkube
and kr8s. Each runs in a fresh interpreter (so import cost and memory are its own) against the same
`kvfleet dev cluster` control plane holding N InferenceDeployments, and LISTs them all R times.
Reported: import time, median LIST latency, CPU seconds for the whole run (imports included), peak
RSS, and whether the client can resume a watch from a resourceVersion and ask for bookmarks.

    python3 -m uv venv /tmp/clients && python3 -m uv pip install --python /tmp/clients/bin/python \
        kubernetes_asyncio lightkube kr8s
    .venv/bin/python bench/kube_clients.py --python /tmp/clients/bin/python [--deployments 200] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import yaml

from kvfleet.devcluster.binaries import ensure_binaries
from kvfleet.devcluster.controlplane import ClusterSettings, ControlPlane

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "benchmarks"

# One program per client: prints one JSON line. Runs in its own interpreter.
PROGRAM = textwrap.dedent(
    """
    import asyncio, json, resource, statistics, sys, time
    t0 = time.perf_counter(); c0 = time.process_time()
    kind, kubeconfig, rounds, expected = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if kind == "kubernetes_asyncio":
        from kubernetes_asyncio import client, config
    elif kind == "lightkube":
        from lightkube import AsyncClient
        from lightkube.config.kubeconfig import KubeConfig
        from lightkube.generic_resource import create_namespaced_resource
    else:
        import kr8s, kr8s.asyncio
    import_s = time.perf_counter() - t0

    async def run():
        times = []
        if kind == "kubernetes_asyncio":
            await config.load_kube_config(kubeconfig)
            async with client.ApiClient() as api:
                co = client.CustomObjectsApi(api)
                for _ in range(rounds):
                    t = time.perf_counter()
                    found = await co.list_cluster_custom_object("kvfleet.io", "v1alpha1", "inferencedeployments")
                    items = found["items"]
                    times.append(time.perf_counter() - t)
        elif kind == "lightkube":
            infd = create_namespaced_resource("kvfleet.io", "v1alpha1", "InferenceDeployment", "inferencedeployments")
            c = AsyncClient(config=KubeConfig.from_file(kubeconfig))
            for _ in range(rounds):
                t = time.perf_counter()
                items = [x async for x in c.list(infd, namespace="*")]
                times.append(time.perf_counter() - t)
            await c.close()
        else:
            api = await kr8s.asyncio.api(kubeconfig=kubeconfig)
            for _ in range(rounds):
                t = time.perf_counter()
                items = [x async for x in api.async_get("inferencedeployments.kvfleet.io", namespace=kr8s.ALL)]
                times.append(time.perf_counter() - t)
        assert len(items) == expected, len(items)
        return times

    times = asyncio.run(run())
    print(json.dumps({
        "client": kind, "import_s": round(import_s, 3),
        "list_median_ms": round(statistics.median(times[2:]) * 1000, 1),
        "cpu_s": round(time.process_time() - c0, 2),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }))
    """
)
# Read from each package's source (the watch call's parameters), recorded beside the figures.
WATCH_FEATURES = {
    "kubernetes_asyncio": "watch resumes from resourceVersion; allow_watch_bookmarks; retries one 410",
    "lightkube": "watch resumes from resourceVersion; on_error handlers; no bookmark parameter; "
    "token files re-read on a 401 (rotation)",
    "kr8s": "watch by label/field selector and since=resourceVersion; no bookmark parameter",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deployments", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--python", default=sys.executable, help="An interpreter with the three clients installed.")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-clients-") as tmp:
        plane = ControlPlane(ClusterSettings(root=Path(tmp), bin_dir=ensure_binaries()))
        plane.start()
        try:
            kubectl = [str(Path(sys.executable).parent / "kubectl"), "--kubeconfig", str(plane.kubeconfig)]
            subprocess.run([*kubectl, "apply", "--server-side", "-f", str(REPO / "crds")], check=True)
            subprocess.run(
                [*kubectl, "wait", "--for=condition=Established", "crd/inferencedeployments.kvfleet.io"], check=True
            )
            docs = [
                {
                    "apiVersion": "kvfleet.io/v1alpha1",
                    "kind": "InferenceDeployment",
                    "metadata": {"name": f"m{i:03d}", "namespace": "default"},
                    "spec": {
                        "model": {"uri": f"s3://model-cache/m{i}"},
                        "resources": {"gpus": 1},
                        "autoscaling": {"minReplicas": 0, "maxReplicas": 4},
                        "cache": {"bucket": "model-cache"},
                    },
                }
                for i in range(args.deployments)
            ]
            subprocess.run(
                [*kubectl, "apply", "--server-side", "-f", "-"],
                input=yaml.safe_dump_all(docs),
                text=True,
                check=True,
                capture_output=True,
            )
            for name in WATCH_FEATURES:
                out = subprocess.run(
                    [
                        args.python,
                        "-c",
                        PROGRAM,
                        name,
                        str(plane.kubeconfig),
                        str(args.rounds),
                        str(args.deployments),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                    cwd=tmp,  # not the repository: its operator/ folder would shadow the standard library
                )
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["watch"] = WATCH_FEATURES[name]
                print(json.dumps(row), flush=True)
                results.append(row)
        finally:
            plane.stop()
    (OUT / "kube_clients.json").write_text(
        json.dumps({"deployments": args.deployments, "rounds": args.rounds, "results": results}, indent=2) + "\n"
    )
    lines = [
        "# Async Kubernetes clients for Python, measured",
        "",
        f"LIST of {args.deployments} InferenceDeployments from a real kube-apiserver v1.36 (`kvfleet dev cluster`),",
        f"{args.rounds} rounds per client in a fresh interpreter; 2 shared cores. "
        "Command: `.venv/bin/python bench/kube_clients.py`.",
        "",
        "| client | import | LIST median | CPU for the run | peak RSS | watch |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['client']} | {r['import_s']} s | {r['list_median_ms']} ms | {r['cpu_s']} s | "
            f"{r['max_rss_mb']} MB | {r['watch']} |"
        )
    lines += [
        "",
        "The LIST latency is mostly the API server's and moves by several ms between runs; CPU, memory",
        "and import time are the client's own and are what the router's event loop and every pod pay.",
        "Bookmarks matter for resuming a watch after a quiet stretch without a relist (410 Gone).",
    ]
    (OUT / "kube_clients.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
