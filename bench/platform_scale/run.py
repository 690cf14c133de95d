"""One scale, every phase in order, the results saved after each phase (a run cut off by its time
bound keeps the figures it reached, marked ``partial``); and ``main``, the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfleet.devcluster.binaries import ensure_binaries
from kvfleet.devcluster.controlplane import ClusterSettings, ControlPlane
from kvfleet.devcluster.nodes import gpu_nodes
from kvfleet.free_port import pick_free_port
from kvfleet.kube import KubeClient

from .apply import apply_all, new_router
from .bad_input import namespace_deleted, oversized
from .change import change_all
from .cluster import RELEASE_NS, Cluster, ScaleRun, components, until_healthy
from .floor import children_floor, floor
from .in_process import autoscaler_tick, router_pick
from .objects import (
    DOOMED,
    GPUS_PER_NODE,
    NAMESPACES,
    REPLICAS,
    SMALL_POOL,
    SMALL_PRODUCT,
    loadavg,
    namespace_of,
    now_iso,
)
from .report import plot, render
from .restart import operator_restart, watch_410
from .steady import steady, steady_reads_by_get

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "benchmarks"
Save = Callable[[dict[str, Any]], None]


def commit() -> str:
    """The code measured: HEAD's short hash, marked when the tree differs from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "kvfleet", "operator", "router", "autoscaler")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")


async def timed(what: str, coro: Awaitable[Any], timeout_s: float) -> Any:
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except TimeoutError:
        print(f"  {what}: timed out after {timeout_s:.0f} s", flush=True)
        return {"timed_out": True}


async def scale_run(
    cluster: Cluster,
    n: int,
    windows: tuple[float, float],
    phase_timeout_s: float,
    save: Save,
    floors: tuple[bool, bool],
) -> dict[str, Any]:
    """``floors``: also the bare-pod floor, also kvfleet's children without its processes."""
    minimal_floor, children = floors
    window_s, baseline_window_s = windows
    result: dict[str, Any] = {"deployments": n, "pods": n * REPLICAS, "started": now_iso(), "loadavg": {}}
    result["commit"] = commit()
    result.update(window_s=window_s, baseline_window_s=baseline_window_s, phase_timeout_s=phase_timeout_s)
    admin = KubeClient.from_kubeconfig(str(cluster.plane.kubeconfig), timeout_s=120)
    s = ScaleRun(cluster, admin, n, window_s, phase_timeout_s, baseline_window_s)

    def done(key: str, value: Any) -> None:
        result[key] = value
        print(f"  {key} {json.dumps(value)}", flush=True)
        save(result)

    try:
        for ns in [*sorted({namespace_of(i, n) for i in range(n)}), "doomed"]:
            await admin.create(NAMESPACES.collection(None), {"metadata": {"name": ns}}, field_manager="bench")
        result["loadavg"]["start"] = loadavg()
        if minimal_floor:
            print(f"[{n}] floor of bare pods: {n} plain Deployments x {REPLICAS} one-container pods", flush=True)
            bare = floor(admin, n, phase_timeout_s, s.cpu_meter(), pods="minimal")
            done("floor_minimal", await timed("floor of bare pods", bare, phase_timeout_s * 3))
        print(f"[{n}] floor: {n} plain Deployments x {REPLICAS} engine pods", flush=True)
        done("floor", await timed("floor", floor(admin, n, phase_timeout_s, s.cpu_meter()), phase_timeout_s * 3))
        s.floor_change_s = None if result["floor"].get("change_timed_out") else result["floor"].get("change_all_s")
        result["loadavg"]["after_floor"] = loadavg()

        s.kc = cluster.install_chart_rbac()
        if children:
            print(f"[{n}] kvfleet's children of {n} deployments, applied with no kvfleet process", flush=True)
            objects_only = children_floor(admin, n, phase_timeout_s, s.cpu_meter())
            done("floor_children", await timed("children without processes", objects_only, phase_timeout_s * 3))
        s.procs = components(s.kc, cluster.folder, pick_free_port())
        for name in ("operator", "autoscaler", "router-0", "router-1"):
            s.procs[name].start()
        # Apply only once the operator runs (kopf's liveness answers): its start-up on a busy machine
        # (imports, login, the first LISTs) is not apply-to-Ready time.
        result["operator_start_s"] = await until_healthy(s.procs["operator"], phase_timeout_s)
        result["operator_rss_at_start_mb"] = s.procs["operator"].rss_mb()  # before any deployment
        applied = await apply_all(s)
        result["loadavg"]["after_apply"] = loadavg()
        done("apply", applied["apply"])
        done("invalid", applied["invalid"])
        result.update(await new_router(s))
        done("steady", await steady(s))
        done("steady_reads_by_get", await steady_reads_by_get(s))
        print(f"[{n}] change all {len(s.valid)}", flush=True)
        done("change_all", await change_all(s))
        done("restart", await operator_restart(s))
        done("watch_410", await watch_410(admin))
        done("namespace_deleted", await namespace_deleted(s))
        done("oversized", await oversized(s))
        result["peak_rss_mb"] = {k: c.peak_rss_mb() for k, c in s.procs.items()}
        result["loadavg"]["end"] = loadavg()
    finally:
        for c in s.procs.values():
            c.stop()
        await admin.close()
    return result


def measure(
    n: int, windows: tuple[float, float], phase_timeout_s: float, bin_dir: Path, save: Save, floors: tuple[bool, bool]
) -> dict[str, Any]:
    # Every pod, one surge pod per deployment while all roll at once, the doomed namespace's pods.
    nodes = max(3, math.ceil((n * (REPLICAS + 1) + DOOMED + 10) / GPUS_PER_NODE))
    with tempfile.TemporaryDirectory(prefix="kvfleet-scale-") as tmp:
        folder = Path(tmp)
        settings = ClusterSettings(
            root=folder / "cluster",
            bin_dir=bin_dir,
            gpu_nodes=nodes,
            gpus_per_node=GPUS_PER_NODE,
            ready_timeout_s=300,
            audit_user_groups=(f"system:serviceaccounts:{RELEASE_NS}",),
        )
        plane = ControlPlane(settings)
        plane.start()
        try:
            # The small pool the oversized deployment asks for.
            from kvfleet.devcluster.admin import AdminApi

            assert plane.state is not None
            api = AdminApi(plane.state.server, plane.pki)
            for node in gpu_nodes(SMALL_POOL[0], gpus=SMALL_POOL[1], product=SMALL_PRODUCT):
                node["metadata"]["name"] = node["metadata"]["name"].replace("kwok-gpu", "kwok-l4")
                node["metadata"]["labels"]["kubernetes.io/hostname"] = node["metadata"]["name"]
                api.call("POST", "/api/v1/nodes", node)
            cluster = Cluster(plane, folder)
            result = asyncio.run(
                scale_run(
                    cluster,
                    n,
                    windows,
                    phase_timeout_s,
                    lambda r: save({**r, "gpu_nodes": nodes + SMALL_POOL[0]}),
                    floors,
                )
            )
            result["gpu_nodes"] = nodes + SMALL_POOL[0]
        finally:
            plane.stop()
    result["autoscaler_tick"] = autoscaler_tick(n)
    save(result)
    result["router_pick"] = router_pick(n)
    return result


def main(doc: str) -> None:
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--deployments", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--window-s", type=float, default=120.0, help="steady-state window (per minute rates)")
    parser.add_argument(
        "--baseline-window-s",
        type=float,
        help="window of the operator reading by GET (default: --window-s; 0 skips it)",
    )
    parser.add_argument("--phase-timeout-s", type=float, default=600.0)
    parser.add_argument("--bin-dir", type=Path, help="the control plane's binaries (default: tools/k8s/build.sh)")
    parser.add_argument(
        "--in-process-only", action="store_true", help="only the autoscaler's tick and the router's pick (no cluster)"
    )
    parser.add_argument(
        "--minimal-floor",
        action="store_true",
        help="also run the floor with bare one-container pods first (what the engine pod's size costs)",
    )
    parser.add_argument(
        "--children-floor",
        action="store_true",
        help="also apply kvfleet's children with no kvfleet process running (what its objects cost the cluster)",
    )
    parser.add_argument("--render-only", action="store_true", help="only write scale.md and scale.png from scale.json")
    parser.add_argument(
        "--results", type=Path, default=OUT / "scale.json", help="the JSON to merge into (scale.md and .png beside it)"
    )
    args = parser.parse_args()
    path: Path = args.results
    out = path.parent
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if args.render_only:
        (out / "scale.md").write_text(render(results))
        plot(results, out / "scale.png")
        return

    def write(n: int, result: dict[str, Any], draw: bool = True) -> None:
        results[str(n)] = result
        path.write_text(json.dumps(results, indent=2) + "\n")
        try:  # the figures are saved above: a report that cannot be drawn must not end the run
            (out / "scale.md").write_text(render(results))
            if draw:
                plot(results, out / "scale.png")
        except Exception as e:
            print(f"  report not written ({e!r}); the figures are in {path}", flush=True)

    for n in args.deployments:
        t0 = time.monotonic()
        if args.in_process_only:
            previous = results.get(str(n)) or {"deployments": n, "pods": n * REPLICAS, "loadavg": {}}
            write(n, {**previous, "autoscaler_tick": autoscaler_tick(n), "router_pick": router_pick(n)})
            continue
        bin_dir = args.bin_dir or ensure_binaries()
        baseline = args.window_s if args.baseline_window_s is None else args.baseline_window_s
        result = measure(
            n,
            (args.window_s, baseline),
            args.phase_timeout_s,
            bin_dir,
            lambda r, n=n: write(n, {**r, "partial": True}, draw=False),
            (args.minimal_floor, args.children_floor),
        )
        result["wall_s"] = round(time.monotonic() - t0, 1)
        write(n, result)
        print(f"[{n}] done in {result['wall_s']} s", flush=True)
    print(f"wrote {path}, scale.md and scale.png")
