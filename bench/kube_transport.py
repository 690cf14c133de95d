"""Benchmark: what one Kubernetes request costs the client, httpx (lightkube's) against aiohttp (``KubeClient``).

Why: at 1,000 deployments the operator sends ~10,000 requests in an apply and reads every watch
event of its children and engine pods, on the same two cores as the API server it waits for
(docs/benchmarks/scale.md). A profile of the operator put ~40 % of its CPU in httpx's request path,
an eighth of it in the connection pool checking every kept connection (a system call each) on every
request and every response.

Against a real kube-apiserver (`kvfleet dev cluster`'s control plane, TLS, client certificate):

- **apply**: ``--objects`` server-side applies of ConfigMaps (~3 KB each, the size of an engine
  Deployment's apply), ``--concurrency`` in flight, over a pool of 64 kept connections (the
  operator's), through each transport; the client's CPU per request (``time.process_time``, the
  API server's CPU is not counted) and the wall time.
- **watch**: one watch that replays the ConfigMaps' ``--objects`` ADDED events from the API server's
  watch cache, read and decoded line by line; the client's CPU per event.

The baseline is the transport KubeClient had until now: lightkube's ``httpx2.AsyncClient`` (its
TLS, credentials and base URL) with the same pool limits, and the same line splitting and JSON
decoding. ``--rounds`` rounds alternate the two; medians are reported.

    .venv/bin/python bench/kube_transport.py [--objects 2000] [--concurrency 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
from lightkube.config.client_adapter import ConnectionParams

from kvfleet.devcluster.binaries import ensure_binaries
from kvfleet.devcluster.controlplane import ClusterSettings, ControlPlane
from kvfleet.kube import KubeClient, Ref
from kvfleet.kube.client import APPLY_PATCH, KEEPALIVE_S, json_lines

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "benchmarks"
CONFIGMAPS = Ref("v1", "configmaps")
NAMESPACE = "default"
POOL = 64  # KubeClient's default bound, kept alive
FIELD_MANAGER = "bench-kube-transport"


def configmap(i: int, rnd: int) -> dict[str, Any]:
    # ~3 KB, the size of an engine Deployment's server-side apply; a new value each round, so every
    # apply writes (the API server's work is the same for both transports).
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"t{i:05d}", "namespace": NAMESPACE, "labels": {"bench": "transport"}},
        "data": {"spec.json": json.dumps({"round": rnd, "pad": "x" * 2900})},
    }


class HttpxTransport:
    """The baseline: lightkube's httpx2 client as KubeClient built it until now."""

    name = "httpx (lightkube)"

    def __init__(self, kube: KubeClient) -> None:
        params = ConnectionParams(timeout=httpx2.Timeout(60.0)).httpx_params(kube.config)
        limits = httpx2.Limits(max_connections=POOL, max_keepalive_connections=POOL, keepalive_expiry=KEEPALIVE_S)
        self.http = httpx2.AsyncClient(**params, limits=limits)
        self.http.headers["Accept"] = "application/json"

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        response = await self.http.request(
            "PATCH",
            CONFIGMAPS.item(meta["namespace"], meta["name"]),
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(obj).encode(),
            headers={"Content-Type": APPLY_PATCH},
        )
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    async def events(self, path: str, params: dict[str, str]) -> Any:
        async with self.http.stream("GET", path, params=params) as response:
            async for event in json_lines(response.aiter_bytes(), 2**21, f"watch {path}"):
                yield event

    async def close(self) -> None:
        await self.http.aclose()


class AiohttpTransport:
    """kvfleet's ``KubeClient`` as the operator, the router and the autoscaler use it."""

    name = "aiohttp (KubeClient)"

    def __init__(self, kube: KubeClient) -> None:
        self.kube = KubeClient(kube.config, timeout_s=60, max_connections=POOL)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.kube.apply(CONFIGMAPS, obj, field_manager=FIELD_MANAGER)

    async def events(self, path: str, params: dict[str, str]) -> Any:
        async for event in self.kube.stream_events(path, params, read_timeout_s=60):
            yield event

    async def close(self) -> None:
        await self.kube.close()


async def measure(cpu: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.monotonic()
    await cpu()
    return time.process_time() - c0, time.monotonic() - t0


async def one_round(
    transport: HttpxTransport | AiohttpTransport, objects: int, concurrency: int, rnd: int
) -> dict[str, float]:
    # Fill the pool first (the operator's is full after its first burst): the cost of a kept pool.
    await asyncio.gather(*(transport.apply(configmap(i, rnd)) for i in range(POOL)))
    gate = asyncio.Semaphore(concurrency)
    first: list[str] = []

    async def applied(i: int) -> None:
        async with gate:
            result = await transport.apply(configmap(i, rnd + 1))
            if i == 0:
                first.append(result["metadata"]["resourceVersion"])

    async def applies() -> None:
        await asyncio.gather(*(applied(i) for i in range(objects)))

    apply_cpu, apply_wall = await measure(applies)
    seen = 0

    async def watch() -> None:
        nonlocal seen
        # Every write since just before the first apply of this round, replayed from the watch cache.
        params = {
            "watch": "true",
            "resourceVersion": str(int(first[0]) - 1),
            "labelSelector": "bench=transport",
            "timeoutSeconds": "60",
        }
        async for _ in transport.events(CONFIGMAPS.collection(NAMESPACE), params):
            seen += 1
            if seen >= objects:
                return

    watch_cpu, _ = await measure(watch)
    return {
        "apply_cpu_ms_per_request": round(apply_cpu / objects * 1000, 3),
        "apply_wall_s": round(apply_wall, 2),
        "watch_cpu_us_per_event": round(watch_cpu / seen * 1e6, 1),
    }


async def run(plane: ControlPlane, objects: int, concurrency: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    kube = KubeClient.from_kubeconfig(str(plane.kubeconfig), timeout_s=60)
    found: dict[str, list[dict[str, float]]] = {HttpxTransport.name: [], AiohttpTransport.name: []}
    try:
        for rnd in range(rounds):
            for kind in (HttpxTransport, AiohttpTransport) if rnd % 2 == 0 else (AiohttpTransport, HttpxTransport):
                transport = kind(kube)
                try:
                    row = await one_round(transport, objects, concurrency, rnd * 10 + (kind is AiohttpTransport))
                finally:
                    await transport.close()
                print(kind.name, json.dumps(row), flush=True)
                found[kind.name].append(row)
    finally:
        await kube.close()
    return found


def median_of(rows: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, default=OUT / "kube_transport.json")
    args = parser.parse_args()
    if not 100 <= args.objects <= 20_000 or not 1 <= args.concurrency <= POOL or not 1 <= args.rounds <= 20:
        sys.exit("--objects in [100, 20000], --concurrency in [1, 64], --rounds in [1, 20]")
    with tempfile.TemporaryDirectory(prefix="kvfleet-transport-") as tmp:
        plane = ControlPlane(ClusterSettings(root=Path(tmp), bin_dir=ensure_binaries()))
        plane.start()
        try:
            found = asyncio.run(run(plane, args.objects, args.concurrency, args.rounds))
        finally:
            plane.stop()
    base, ours = found[HttpxTransport.name], found[AiohttpTransport.name]
    summary = {
        key: {
            "httpx": median_of(base, key),
            "aiohttp": median_of(ours, key),
            "ratio": round(median_of(base, key) / max(median_of(ours, key), 1e-9), 2),
        }
        for key in ("apply_cpu_ms_per_request", "apply_wall_s", "watch_cpu_us_per_event")
    }
    result = {
        "objects": args.objects,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "pool": POOL,
        "summary": summary,
        "rounds_raw": found,
    }
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    s = summary
    lines = [
        "# One Kubernetes request, client side: httpx (lightkube) against aiohttp (KubeClient)",
        "",
        f"{args.objects} server-side applies of ~3 KB ConfigMaps, {args.concurrency} in flight over a kept pool of "
        f"{POOL} connections, and one watch replaying their {args.objects} events, against a real kube-apiserver "
        "(`kvfleet dev cluster`'s control plane, TLS with a client certificate) on the same 2 cores. "
        f"Client CPU only (the API server's is the same for both); medians of {args.rounds} alternating rounds. "
        "Command: `.venv/bin/python bench/kube_transport.py`.",
        "",
        "| figure | httpx (lightkube, until now) | aiohttp (KubeClient) | ratio |",
        "|---|---|---|---|",
        f"| client CPU per apply | {s['apply_cpu_ms_per_request']['httpx']} ms | "
        f"{s['apply_cpu_ms_per_request']['aiohttp']} ms | {s['apply_cpu_ms_per_request']['ratio']}x |",
        f"| wall time of the applies | {s['apply_wall_s']['httpx']} s | {s['apply_wall_s']['aiohttp']} s | "
        f"{s['apply_wall_s']['ratio']}x |",
        f"| client CPU per watch event | {s['watch_cpu_us_per_event']['httpx']} us | "
        f"{s['watch_cpu_us_per_event']['aiohttp']} us | {s['watch_cpu_us_per_event']['ratio']}x |",
        "",
        "Why it matters: the operator, the routers and the autoscaler run their requests and watches on",
        "the cores the control plane needs at scale; what the client saves is CPU the API server, the",
        "controllers and kwok get (docs/benchmarks/scale.md). The wall time includes the API server's",
        "own work, which is the same for both and most of it.",
    ]
    args.results.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
