"""Benchmark: API-server requests per minute made by kvfleet's control plane at 1 and N deployments.

Runs the real control plane (`kvfleet dev cluster`'s etcd, kube-apiserver, controller-manager,
scheduler and kwok nodes), creates N InferenceDeployments, starts the operator, one router and the
autoscaler as processes of their own, each with the token of its own ServiceAccount, waits until
every deployment is reconciled, then counts the requests each component makes over a steady-state
window from the API server's audit log (one entry per request, watches included). Deployments are
scaled to zero so the figure is the control plane's own cost, not pods'.

    .venv/bin/python bench/apiserver_load.py --deployments 1 200 --window-s 60 --label before

Results accumulate by label in docs/benchmarks/apiserver_load.json (a "before" and an "after" run
of the same script make the comparison) and are rendered to docs/benchmarks/apiserver_load.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from kvfleet.devcluster.binaries import ensure_binaries
from kvfleet.devcluster.controlplane import ClusterSettings, ControlPlane, kubeconfig_document
from kvfleet.free_port import pick_free_port

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "benchmarks"
BIN = Path(sys.executable).parent
COMPONENTS = ("operator", "router", "autoscaler")
NAMESPACE = "load"


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        [str(BIN / "kubectl"), "--kubeconfig", str(kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)}: {result.stderr}")
    return result.stdout


def deployment(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": f"m{i:03d}", "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": f"s3://model-cache/models/m{i:03d}"},
            "engine": {"kind": "vllm"},
            "resources": {"gpus": 1},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 4},
            "cache": {"bucket": "model-cache"},
        },
    }


def identities(plane: ControlPlane, folder: Path) -> dict[str, Path]:
    """A ServiceAccount per component (cluster-admin: this measures load, not RBAC) and its kubeconfig."""
    admin = plane.kubeconfig
    kubectl(admin, "create", "namespace", "kvfleet-system")
    found = {}
    for name in COMPONENTS:
        kubectl(admin, "create", "serviceaccount", name, "-n", "kvfleet-system")
        kubectl(
            admin,
            "create",
            "clusterrolebinding",
            f"load-{name}",
            "--clusterrole=cluster-admin",
            f"--serviceaccount=kvfleet-system:{name}",
        )
        token = kubectl(admin, "create", "token", name, "-n", "kvfleet-system", "--duration=2h").strip()
        (folder / f"{name}.token").write_text(token)
        path = folder / f"{name}.kubeconfig"
        assert plane.state is not None
        path.write_text(
            kubeconfig_document(
                plane.state.server, plane.pki.ca_cert, {"tokenFile": str(folder / f"{name}.token")}, name=name
            )
        )
        found[name] = path
    return found


def start(folder: Path, kc: dict[str, Path]) -> list[subprocess.Popen[bytes]]:
    kvfleet = str(BIN / "kvfleet")
    autoscaler_port = pick_free_port()
    argv = {
        "operator": [kvfleet, "operator", "run"],
        "router": [
            kvfleet,
            "router",
            "serve",
            "--kubernetes",
            "--kubeconfig",
            str(kc["router"]),
            "--port",
            str(pick_free_port()),
            "--autoscaler-url",
            f"http://127.0.0.1:{autoscaler_port}",
        ],
        "autoscaler": [
            kvfleet,
            "autoscaler",
            "run",
            "--prometheus-url",
            "http://127.0.0.1:9",
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            str(autoscaler_port),
            "--leader-election",
            "--identity",
            "bench",
            "--lease-namespace",
            "kvfleet-system",
            "--kubeconfig",
            str(kc["autoscaler"]),
        ],
    }
    procs = []
    for name in COMPONENTS:
        with open(folder / f"{name}.log", "ab") as log:
            procs.append(
                subprocess.Popen(
                    argv[name], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(kc[name])}
                )
            )
    return procs


def converged(admin: Path, n: int) -> bool:
    items = json.loads(kubectl(admin, "get", "infd", "-n", NAMESPACE, "-o", "json"))["items"]
    return len(items) == n and all((i.get("status") or {}).get("conditions") for i in items)


def count(audit: Path, since: str, until: str) -> dict[str, dict[str, int]]:
    users = {f"system:serviceaccount:kvfleet-system:{c}": c for c in COMPONENTS}
    seen: dict[str, set[str]] = collections.defaultdict(set)
    verbs: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in audit.read_text().splitlines():
        entry = json.loads(line)
        who = users.get(entry.get("user", {}).get("username", ""))
        stamp = entry.get("requestReceivedTimestamp", "")
        if who is None or not since <= stamp < until or entry["auditID"] in seen[who]:
            continue
        seen[who].add(entry["auditID"])
        verbs[who][entry["verb"]] += 1
    return {c: dict(verbs[c]) for c in COMPONENTS}


def measure(n: int, window_s: float, bin_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvfleet-load-") as tmp:
        folder = Path(tmp)
        plane = ControlPlane(ClusterSettings(root=folder / "cluster", bin_dir=bin_dir))
        plane.start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            admin = plane.kubeconfig
            kubectl(admin, "apply", "--server-side", "-f", str(REPO / "crds"))
            kubectl(admin, "wait", "--for=condition=Established", "crd/inferencedeployments.kvfleet.io")
            kc = identities(plane, folder)
            kubectl(admin, "create", "namespace", NAMESPACE)
            kubectl(
                admin, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all([deployment(i) for i in range(n)])
            )
            procs = start(folder, kc)
            t0 = time.monotonic()
            while not converged(admin, n):
                if time.monotonic() - t0 > 600:
                    raise SystemExit(f"{n} deployments did not converge in 600 s")
                time.sleep(2)
            settle_s = time.monotonic() - t0
            time.sleep(10)  # the first resync after convergence passes
            since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            time.sleep(window_s)
            until = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            per = count(Path(plane.settings.root) / "logs" / "audit.log", since, until)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
            plane.stop()
    scale = 60.0 / window_s
    return {
        "deployments": n,
        "window_s": window_s,
        "converged_after_s": round(settle_s, 1),
        "per_minute": {c: round(sum(v.values()) * scale, 1) for c, v in per.items()},
        "by_verb_per_minute": {c: {k: round(x * scale, 1) for k, x in sorted(v.items())} for c, v in per.items()},
    }


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "# API-server load of kvfleet's control plane",
        "",
        "Requests per minute each component sends to a real kube-apiserver (v1.36, `kvfleet dev cluster`)",
        "in steady state, counted from the API server's audit log (watches count once per request).",
        "Deployments are scaled to zero. Command: `.venv/bin/python bench/apiserver_load.py --deployments 1 200",
        "--window-s S --label <label>` (each run's window is in the table); machine: 2 cores, shared. The",
        '"converged after" column is the operator\'s time to first status, sensitive to other load on the',
        'machine (the 1-deployment "after" run shared its 2 cores with a test run).',
        "",
        "| label | deployments | operator | router | autoscaler | total | window | converged after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in results.items():
        for r in runs:
            pm = r["per_minute"]
            lines.append(
                f"| {label} | {r['deployments']} | {pm['operator']} | {pm['router']} | {pm['autoscaler']} | "
                f"{round(sum(pm.values()), 1)} | {r['window_s']:.0f} s | {r['converged_after_s']} s |"
            )
    lines += [
        "",
        "Reading the figures:",
        "",
        "- before: the router and the autoscaler each had a hand-written aiohttp client; the autoscaler",
        "  LISTed every InferenceDeployment every 2 s tick and read its Lease before each renewal; the router",
        "  LISTed both resources again after every watch end (`timeoutSeconds` 300 s).",
        "- after: both share `kvfleet.kube` (lightkube-configured): one LIST per resource at start, then",
        "  watches resumed from the last resourceVersion (with bookmarks) when the server ends them",
        "  (`timeoutSeconds` drawn from 300-600 s); the autoscaler's ticks read memory and its Lease is",
        "  renewed with one conditional PATCH. Its remaining 30/min are those renewals (client-go's 2 s).",
        "- The router's steady state is below one request per window either way (before: 2 LISTs and",
        "  2 WATCHes per 300 s, 0.8/min; after: 2 WATCHes per 300-600 s, 0.2-0.4/min), so a window rarely",
        "  holds one; the audit log of a window only shows it when a watch happens to end inside it.",
        "- The operator is unchanged (kopf); its figures move with its resync timing.",
    ]
    lines += ["", "Requests per minute by verb:", ""]
    for label, runs in results.items():
        for r in runs:
            for c, verbs in r["by_verb_per_minute"].items():
                lines.append(f"- {label}, {r['deployments']} deployments, {c}: {verbs}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deployments", type=int, nargs="+", default=[1, 200])
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--label", default="current")
    args = parser.parse_args()
    bin_dir = ensure_binaries()
    path = OUT / "apiserver_load.json"
    results: dict[str, list[dict[str, Any]]] = json.loads(path.read_text()) if path.exists() else {}
    runs = []
    for n in args.deployments:
        run = measure(n, args.window_s, bin_dir)
        print(json.dumps(run), flush=True)
        runs.append(run)
    results[args.label] = runs
    path.write_text(json.dumps(results, indent=2) + "\n")
    (OUT / "apiserver_load.md").write_text(render(results))
    print(f"wrote {path} and apiserver_load.md")


if __name__ == "__main__":
    main()
