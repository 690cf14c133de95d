"""Real engines: 4 reference-engine replicas behind the router on a shared-prefix workload, kvfleet's
prefix routing vs round-robin. The prefix-cache hit rate is read from the engines' own metrics
(vllm:prefix_cache_hits / vllm:prefix_cache_queries, summed over replicas); TTFT is measured by the
client (request sent to first streamed token), p50/p99.

Each replica's KV cache holds about a third of the tenants' system prompts; the fleet holds them all.
Engines start once; each run uses fresh tenant prompts (so it starts cold on them) and runs
alternate between strategies, several rounds, medians reported.

    .venv/bin/python bench/router_real.py                 # ~3-5 minutes on 2 busy cores
    .venv/bin/python bench/router_real.py --requests 400 --rounds 3

Writes docs/benchmarks/router_real.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec
from kvfleet_testkit.engines import Engine, start_engine

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "docs" / "benchmarks"
SERVED = "bench"
BLOCK_CHARS = 64


def words(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def workload(seed: int, tenants: int, requests: int, system_chars: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    systems = [f"[tenant {seed}-{t}] " + words(rng, system_chars) for t in range(tenants)]
    weights = [1 / (i + 1) ** 0.5 for i in range(tenants)]
    bodies = []
    for _ in range(requests):
        t = rng.choices(range(tenants), weights)[0]
        messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": words(rng, 60)}]
        bodies.append({"model": SERVED, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True})
    return bodies


async def stream_trace(
    pick_url: Callable[[], str], engines: list[Engine], bodies: list[dict[str, Any]], concurrency: int
) -> dict[str, Any]:
    """Stream ``bodies`` as chat requests, ``concurrency`` at a time in trace order, each to the router
    ``pick_url()`` names: the engines' own prefix-cache hit rate over the run (their counters' deltas),
    TTFT by the client (request sent to first streamed byte), requests served per replica (the router's
    ``X-Kvfleet-Replica``) and max/mean of those over the engines."""
    before = [e.metrics() for e in engines]
    ttft: list[float] = []
    served: Counter[str] = Counter({e.replica_id: 0 for e in engines})
    errors = 0
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    async with aiohttp.ClientSession() as session:
        loop = asyncio.get_running_loop()

        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                body = queue.get_nowait()
                t0 = loop.time()
                first = None
                async with session.post(pick_url() + "/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    served[resp.headers["X-Kvfleet-Replica"]] += 1
                    async for _ in resp.content.iter_any():
                        if first is None:
                            first = loop.time()
                if first is not None:
                    ttft.append(first - t0)

        started = loop.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = loop.time() - started
    after = [e.metrics() for e in engines]
    hits = sum(
        a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
        for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
        for a, b in zip(after, before, strict=True)
    )
    ttft.sort()
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
        "imbalance": max(served.values()) / (sum(served.values()) / len(engines)),
        "served": dict(served),
        "errors": errors,
        "elapsed_s": elapsed,
    }


async def run_one(
    engines: list[Engine], strategy: str, bodies: list[dict[str, Any]], concurrency: int, index_blocks: int
) -> dict[str, Any]:
    source = StaticReplicaSource()
    source.set_deployment(SERVED, routing=RoutingSpec(strategy=strategy, prefix_block_chars=BLOCK_CHARS))
    for engine in engines:
        source.add(SERVED, engine.replica_id, engine.url, kv_capacity_blocks=index_blocks)
    server = RouterServer(RouterSettings(port=0), source, NoWakeSignal())
    await server.start()
    try:
        return await stream_trace(lambda: server.url, engines, bodies, concurrency)
    finally:
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=160, help="per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-chars", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=128, help="per engine, of 16 tokens")
    parser.add_argument("--layers", type=int, default=4, help="of the random-weight model")
    parser.add_argument("--hidden", type=int, default=256, help="of the random-weight model")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"kvfleet": [], "round-robin": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", layers=args.layers, hidden=args.hidden, vocab=2048)
        engines: list[Engine] = []
        try:
            t0 = time.monotonic()
            for i in range(args.replicas):
                engines.append(
                    start_engine(
                        model, f"e{i}", Path(tmp), SERVED, "--kv-blocks", str(args.kv_blocks), "--block-size", "16"
                    )
                )
            print(f"{args.replicas} engines up in {time.monotonic() - t0:.0f} s")
            # Router index bound from the engine's KV size: tokens x ~1.6 chars per token (this tokenizer) / block.
            index_blocks = max(1, int(args.kv_blocks * 16 * 1.6 / BLOCK_CHARS))
            for r in range(args.rounds):
                for k, (name, strategy) in enumerate([("kvfleet", "prefix"), ("round-robin", "round-robin")]):
                    bodies = workload(
                        seed=1000 * r + k, tenants=args.tenants, requests=args.requests, system_chars=args.system_chars
                    )
                    result = asyncio.run(run_one(engines, strategy, bodies, args.concurrency, index_blocks))
                    results[name].append(result)
                    print(
                        f"round {r} {name:12s} hit {result['hit_rate']:.3f} "
                        f"ttft p50 {result['ttft_p50_s'] * 1000:.0f} ms "
                        f"p99 {result['ttft_p99_s'] * 1000:.0f} ms imbalance {result['imbalance']:.2f} "
                        f"errors {result['errors']} ({result['elapsed_s']:.0f} s)"
                    )
        finally:
            for engine in engines:
                engine.stop()
    write(args, results)


def write(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        name: {
            key: statistics.median(r[key] for r in runs)
            for key in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "imbalance")
        }
        for name, runs in results.items()
    }
    (out / "router_real.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "cpus": os.cpu_count(),
                "summary": summary,
                "runs": results,
            },
            indent=2,
        )
    )
    ours, rr = summary["kvfleet"], summary["round-robin"]
    lines = [
        f"{args.replicas} reference engines (random model, {args.layers} layers x {args.hidden} hidden, CPU, "
        "1 thread each), "
        f"{args.kv_blocks} KV blocks of 16 tokens per engine; {args.tenants} tenants' system prompts of "
        f"{args.system_chars} chars; {args.requests} streamed chat requests per run, {args.concurrency} at a time; "
        f"{args.rounds} rounds, medians. Router in process with the client; {os.cpu_count()} shared cores "
        f"(load average {os.getloadavg()[0]:.1f} at the end).",
        "",
        "| strategy | engine prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | imbalance (max/mean served) |",
        "|---|---|---|---|---|",
    ]
    for name, m in summary.items():
        lines.append(
            f"| {name} | {m['hit_rate']:.3f} | {m['ttft_p50_s'] * 1000:.0f} | {m['ttft_p99_s'] * 1000:.0f} | "
            f"{m['imbalance']:.2f} |"
        )
    lines += [
        "",
        f"kvfleet vs round-robin: hit rate {ours['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
        f"TTFT p50 {rr['ttft_p50_s'] / ours['ttft_p50_s']:.2f}x better, "
        f"p99 {rr['ttft_p99_s'] / ours['ttft_p99_s']:.2f}x better.",
    ]
    (out / "router_real.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(summary)
    a.bar(names, [summary[n]["hit_rate"] for n in names], color=["tab:blue", "grey"])
    a.set_title("engine prefix-cache hit rate")
    xs = range(len(names))
    b.bar([x - 0.2 for x in xs], [summary[n]["ttft_p50_s"] * 1000 for n in names], 0.4, label="p50")
    b.bar([x + 0.2 for x in xs], [summary[n]["ttft_p99_s"] * 1000 for n in names], 0.4, label="p99")
    b.set_xticks(list(xs), names)
    b.set_ylabel("ms")
    b.set_title("TTFT (client)")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "router_real.png", dpi=100)


if __name__ == "__main__":
    main()
