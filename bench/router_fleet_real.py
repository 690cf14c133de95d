"""Several router processes in front of real engines: does prefix routing survive the HA router fleet?

4 reference-engine processes, and 1 or 3 `kvfleet router serve` processes (separate processes, so each
has its own Python hash key, index and in-flight counts, as router pods do); every request goes to a
router picked at random, as a Service spreads connections. Configurations, each with fresh router
processes (empty) and fresh prompts (so the engines start cold on them):

- ``kvfleet, 1 router``: one router, today's defaults (placement on);
- ``kvfleet, 3 routers``: the same, three routers;
- ``kvfleet before, 3 routers``: three routers without placement or load-bound slack (the router
  before it could agree with its peers);
- ``round-robin, 3 routers``;
- ``kvfleet + KV events, 3 routers``: the same three routers subscribed to every engine's KV-cache
  events (the engines publish them in every configuration; only these routers read them), prompts
  tokenized with the model's tokenizer and chat template;
- ``kvfleet + KV events + peer load, 3 routers``: the same, and each router sends its per-replica
  counts to the two others over signed UDP (``peer_load_port``; router/peer_link.py);
- ``kvfleet + KV events, 1 router``: one such router (what the three should route like).

Two workloads: multi-turn chat (a shared system prompt, conversations whose prompts grow turn by
turn; consecutive turns of a conversation are spread apart in the trace, so they reach different
routers) and multi-tenant system prompts (tenants' prompts followed by one-off questions). Hit rate
from the engines' own vllm:prefix_cache_hits / vllm:prefix_cache_queries deltas; TTFT by the client
to the first streamed byte.

    .venv/bin/python bench/router_fleet_real.py               # ~6-8 minutes on 2 busy cores
    .venv/bin/python bench/router_fleet_real.py --rounds 1 --requests 120

Writes docs/benchmarks/router_fleet_real.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# Run as a script, this folder is first on sys.path: the sibling benchmark imports as a top-level module.
from router_real import stream_trace, words

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.free_port import pick_free_port
from kvfleet_testkit.engines import Engine, start_engine

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "docs" / "benchmarks"
SERVED = "bench"
CONFIGS: dict[str, tuple[int, list[str]]] = {  # name -> (routers, extra `router serve` arguments)
    "kvfleet, 1 router": (1, ["--strategy", "prefix"]),
    "kvfleet, 3 routers": (3, ["--strategy", "prefix"]),
    "kvfleet before, 3 routers": (3, ["--strategy", "prefix", "--no-placement", "--load-bound-slack-requests", "0"]),
    "round-robin, 3 routers": (3, ["--strategy", "round-robin"]),
    "kvfleet + KV events, 3 routers": (3, ["--strategy", "prefix"]),
    "kvfleet + KV events + peer load, 3 routers": (3, ["--strategy", "prefix"]),
    "kvfleet + KV events, 1 router": (1, ["--strategy", "prefix"]),
}
EVENTS_CONFIGS = {
    "kvfleet + KV events, 3 routers",
    "kvfleet + KV events + peer load, 3 routers",
    "kvfleet + KV events, 1 router",
}
PEER_LOAD_CONFIGS = {"kvfleet + KV events + peer load, 3 routers"}  # the routers report their counts to each other


def body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": SERVED, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}


def chat(seed: int, requests: int, open_conversations: int) -> list[dict[str, Any]]:
    """Conversations after a shared system prompt; each turn adds a reply and a user message. Turns are
    taken round-robin over the open conversations, so a conversation's next turn comes
    ``open_conversations`` requests later (after its previous turn finished) and most likely through
    another router."""
    rng = random.Random(seed)
    system = {"role": "system", "content": f"[app {seed}] You are a helpful assistant. " + words(rng, 500)}
    histories: list[list[dict[str, str]]] = []
    out = []
    while len(out) < requests:
        while len(histories) < open_conversations:
            histories.append([system, {"role": "user", "content": words(rng, 120)}])
        for h in list(histories):
            out.append(body(list(h)))
            h += [{"role": "assistant", "content": words(rng, 200)}, {"role": "user", "content": words(rng, 80)}]
            if len(h) > 12 or rng.random() < 0.15:
                histories.remove(h)
    return out[:requests]


def tenants(seed: int, requests: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    systems = [f"[tenant {seed}-{t}] " + words(rng, 1200) for t in range(count)]
    weights = [1 / (i + 1) ** 0.5 for i in range(count)]
    out = []
    for _ in range(requests):
        t = rng.choices(range(count), weights)[0]
        out.append(body([{"role": "system", "content": systems[t]}, {"role": "user", "content": words(rng, 60)}]))
    return out


def start_routers(
    n: int,
    engines: list[Engine],
    extra: list[str],
    settings: Path,
    log_dir: Path,
    events: list[int] | None = None,
    peer_load: bool = False,
) -> list[Any]:
    """``events``: each engine's KV-events port, for routers that subscribe (``settings`` then enables it).
    ``peer_load``: the routers exchange their load counts (a settings file each: its own UDP port)."""
    routers = []
    peer_ports = [pick_free_port() for _ in range(n)] if peer_load else []
    for i in range(n):
        port = pick_free_port()
        kvfleet = str(Path(sys.executable).parent / "kvfleet")
        own_settings = settings
        if peer_load:
            key = log_dir / "peer.key"
            key.write_text("bench-peer-load-key-" + "x" * 32)
            own_settings = log_dir / f"router-{i}-peers.yaml"
            doc = json.loads(settings.read_text())
            doc |= {
                "peer_load_port": peer_ports[i],
                "peer_load_peers": [f"127.0.0.1:{p}" for p in peer_ports],
                "peer_load_key_file": str(key),
            }
            own_settings.write_text(json.dumps(doc))
        cmd = [kvfleet, "router", "serve", "--port", str(port), "--settings", str(own_settings)]
        for j, e in enumerate(engines):
            cmd += ["--replica", f"{SERVED}={e.url}" + (f",kv-events-port={events[j]}" if events else "")]
        cmd += extra
        log = (log_dir / f"router-{i}-{port}.log").open("wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        routers.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in routers:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"router {url} did not start") from None
                time.sleep(0.1)
    return routers


async def drive(
    router_urls: list[str], engines: list[Engine], bodies: list[dict[str, Any]], seed: int
) -> dict[str, Any]:
    """Send the trace, each request through a random router, ``concurrency`` at a time in trace order."""
    rng = random.Random(seed)
    return await stream_trace(lambda: rng.choice(router_urls), engines, bodies, CONCURRENCY)


CONCURRENCY = 4


def main() -> None:
    global CONCURRENCY
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=160, help="per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--kv-blocks", type=int, default=256, help="per engine, of 16 tokens")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--configs", default=";".join(CONFIGS), help="configurations to run, separated by ;")
    args = parser.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(";")}
    CONCURRENCY = args.concurrency
    workloads = {
        "multi-turn chat": lambda seed: chat(seed, args.requests, open_conversations=8),
        "multi-tenant system prompts": lambda seed: tenants(seed, args.requests, count=8),
    }
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {c: [] for c in configs} for w in workloads}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", layers=4, hidden=256, vocab=2048)
        # The router's index bound from the engine's KV size: tokens x ~1.6 chars per token / 128-char blocks.
        settings = Path(tmp) / "router.yaml"
        index_blocks = max(1, int(args.kv_blocks * 16 * 1.6 / 128))
        settings.write_text(json.dumps({"prefix_index_blocks_per_replica": index_blocks}))
        events_settings = Path(tmp) / "router-events.yaml"
        events_settings.write_text(
            json.dumps(
                {
                    "prefix_index_blocks_per_replica": index_blocks,
                    "kv_events_port": 5557,  # each replica names its own below
                    "kv_events_tokenizers": {SERVED: str(model)},
                }
            )
        )
        event_ports = [pick_free_port() for _ in range(args.replicas)]
        engines = [
            start_engine(
                model,
                f"e{i}",
                Path(tmp),
                SERVED,
                *("--kv-blocks", str(args.kv_blocks), "--block-size", "16"),
                *("--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})),
            )
            for i, port in enumerate(event_ports)
        ]
        try:
            for r in range(args.rounds):
                for w, (workload, make) in enumerate(workloads.items()):
                    for config, (n, extra) in configs.items():
                        k = list(CONFIGS).index(config)
                        seed = 10_000 * r + 100 * w + k
                        if config in EVENTS_CONFIGS:
                            routers = start_routers(
                                n, engines, extra, events_settings, Path(tmp), event_ports, config in PEER_LOAD_CONFIGS
                            )
                        else:
                            routers = start_routers(n, engines, extra, settings, Path(tmp))
                        try:
                            res = asyncio.run(drive([u for _, u in routers], engines, make(seed), seed))
                        finally:
                            for proc, _ in routers:
                                proc.terminate()
                                proc.wait(30)
                        results[workload][config].append(res)
                        print(
                            f"round {r} {workload:28s} {config:26s} hit {res['hit_rate']:.3f} "
                            f"ttft mean {res['ttft_mean_s'] * 1000:.0f} p50 {res['ttft_p50_s'] * 1000:.0f} "
                            f"p99 {res['ttft_p99_s'] * 1000:.0f} ms imbalance {res['imbalance']:.2f} "
                            f"errors {res['errors']}",
                            flush=True,
                        )
        finally:
            for e in engines:
                e.stop()
    write(args, results, time.monotonic() - started)


def write(args: argparse.Namespace, results: dict[str, dict[str, list[dict[str, Any]]]], elapsed_s: float) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    keys = ("hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "imbalance")
    summary = {
        w: {c: {k: statistics.median(r[k] for r in runs) for k in keys} for c, runs in per.items()}
        for w, per in results.items()
    }
    (args.out / "router_fleet_real.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "elapsed_s": elapsed_s,
                "summary": summary,
                "runs": results,
            },
            indent=2,
        )
    )
    lines = [
        f"{args.replicas} reference engines (random model, 4 layers x 256 hidden, CPU, 1 thread each, "
        f"{args.kv_blocks} KV blocks of 16 tokens), 1 or 3 `kvfleet router serve` processes, each request to a "
        f"random router; {args.requests} streamed chat requests per run, {args.concurrency} at a time; "
        f"{args.rounds} rounds, medians; {os.cpu_count()} shared cores (load average {os.getloadavg()[0]:.1f} "
        "at the end).",
        "",
        "| workload | configuration | engine prefix-cache hit rate | TTFT mean (ms) | TTFT p50 (ms) | "
        "TTFT p99 (ms) | imbalance (max/mean served) |",
        "|---|---|---|---|---|---|---|",
    ]
    for w, per in summary.items():
        for c, m in per.items():
            lines.append(
                f"| {w} | {c} | {m['hit_rate']:.3f} | {m['ttft_mean_s'] * 1000:.0f} | {m['ttft_p50_s'] * 1000:.0f} | "
                f"{m['ttft_p99_s'] * 1000:.0f} | {m['imbalance']:.2f} |"
            )
    (args.out / "router_fleet_real.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
