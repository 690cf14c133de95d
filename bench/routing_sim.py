"""Trace-driven simulation of routing strategies over N engine replicas.

Each replica is modelled as an engine with an exact LRU prefix cache (block hashes, tails evicted
first, as vLLM frees them) and ``slots`` concurrent sequences; a request's modelled TTFT is its wait
for a slot plus the prefill of its uncached tokens. The strategies are round-robin, least-load,
sticky consistent hashing on the prompt's first blocks (no load bound, like KubeAI's CHWBL without
its bound), and kvfleet's own picker -- the real ``kvfleet.router.picking`` code, not a copy.

    .venv/bin/python bench/routing_sim.py                # default sizes, ~1 minute
    .venv/bin/python bench/routing_sim.py --requests 20000 --replicas 16

Writes docs/benchmarks/router_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import json
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.router.picking import Candidate, PickRequest, build_strategy
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import block_hashes
from kvfleet.spec import RoutingSpec

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
BLOCK_CHARS = 128
CHARS_PER_TOKEN = 4
MODEL = "sim"


@dataclass(frozen=True)
class Params:
    replicas: int
    requests: int
    cache_blocks: int  # per replica: 2048 blocks x 32 tokens = 64k tokens of KV (a 70B model on 2 H100s)
    slots: int  # concurrent sequences per replica
    prefill_s_per_token: float
    decode_s_per_token: float
    output_tokens: int
    utilisation: float  # offered load as a fraction of the fleet's capacity with no cache hits
    seed: int
    bound: float  # kvfleet's loadImbalanceBound


@dataclass
class Request:
    arrival_s: float
    prompt: str
    hashes: list[int] = field(default_factory=list)


# -- workloads --------------------------------------------------------------------------------------


def words(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def zipf_choice(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights)[0]


def multi_tenant(rng: random.Random, n: int) -> list[str]:
    # 128 tenants' system prompts (~2000 tokens each) are ~4x one replica's cache but fit the fleet's.
    tenants = [f"[tenant {t}] " + words(rng, 8000) for t in range(128)]
    return [tenants[zipf_choice(rng, 128)] + "\nUser: " + words(rng, 400) for _ in range(n)]


def multi_turn_chat(rng: random.Random, n: int) -> list[str]:
    system = "You are a helpful assistant. " + words(rng, 200)
    sessions: list[str] = []
    prompts: list[str] = []
    active: list[int] = []
    for _ in range(n):
        if len(active) < 150 or rng.random() < 0.1:  # new conversations keep arriving
            sessions.append(system + "\nUser: " + words(rng, 600))
            active.append(len(sessions) - 1)
        s = rng.choice(active)
        prompts.append(sessions[s])
        # the next turn extends this one: the reply and a new user message
        sessions[s] += "\nAssistant: " + words(rng, 800) + "\nUser: " + words(rng, 300)
        if len(sessions[s]) > 24_000:
            active.remove(s)
    return prompts


def rag(rng: random.Random, n: int) -> list[str]:
    system = "Answer from the documents below. " + words(rng, 200)
    docs = [f"<doc {d}> " + words(rng, 4000) for d in range(300)]
    prompts = []
    for _ in range(n):
        picked: list[int] = []
        while len(picked) < 3:
            d = zipf_choice(rng, len(docs), 1.2)
            if d not in picked:
                picked.append(d)
        prompts.append(system + "".join(docs[d] for d in picked) + "\nQuestion: " + words(rng, 300))
    return prompts


def nothing_shared(rng: random.Random, n: int) -> list[str]:
    return [f"{i} " + words(rng, rng.randint(2000, 9000)) for i in range(n)]


WORKLOADS: dict[str, Callable[[random.Random, int], list[str]]] = {
    "multi-tenant system prompts": multi_tenant,
    "multi-turn chat": multi_turn_chat,
    "RAG over shared documents": rag,
    "nothing shared": nothing_shared,
}

# -- replicas ---------------------------------------------------------------------------------------


class Engine:
    """An engine replica: an exact LRU prefix cache and ``slots`` concurrent sequences."""

    def __init__(self, cache_blocks: int, slots: int) -> None:
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.capacity = cache_blocks
        self.slots = slots
        self.running = 0
        self.waiting: deque[tuple[float, Request]] = deque()
        self.assigned = 0  # queued + running: the load the router sees
        self.served = 0

    def hit_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in reversed(hashes):
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


# -- strategies -------------------------------------------------------------------------------------

Router = Callable[[Request, list[Engine]], int]


def round_robin() -> Router:
    turn = [0]

    def route(req: Request, engines: list[Engine]) -> int:
        turn[0] += 1
        return turn[0] % len(engines)

    return route


def least_load() -> Router:
    turn = [0]

    def route(req: Request, engines: list[Engine]) -> int:
        least = min(e.assigned for e in engines)
        tied = [i for i, e in enumerate(engines) if e.assigned == least]
        turn[0] += 1
        return tied[turn[0] % len(tied)]

    return route


def sticky_hash(n_replicas: int, key_blocks: int = 2, vnodes: int = 100) -> Router:
    ring = sorted(
        (int.from_bytes(hashlib.blake2b(f"{r}-{v}".encode(), digest_size=8).digest(), "big"), r)
        for r in range(n_replicas)
        for v in range(vnodes)
    )
    points = [p for p, _ in ring]

    def route(req: Request, engines: list[Engine]) -> int:
        key = req.prompt[: key_blocks * BLOCK_CHARS].encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        return ring[bisect.bisect(points, h) % len(ring)][1]

    return route


def kvfleet(cache_blocks: int, bound: float) -> Router:
    index = PrefixIndex(cache_blocks)
    routing = RoutingSpec(prefix_block_chars=BLOCK_CHARS, load_imbalance_bound=bound)
    strategy = build_strategy(routing, index, load_penalty_blocks=4)

    def route(req: Request, engines: list[Engine]) -> int:
        candidates = [Candidate(str(i), e.assigned) for i, e in enumerate(engines)]
        pick = strategy.pick(candidates, PickRequest(req.hashes))
        assert pick is not None
        index.record(pick.replica_id, req.hashes)
        return int(pick.replica_id)

    return route


# -- simulation -------------------------------------------------------------------------------------


def simulate(requests: list[Request], route: Router, p: Params) -> dict[str, float]:
    engines = [Engine(p.cache_blocks, p.slots) for _ in range(p.replicas)]
    events: list[tuple[float, int, str, int, Request | None]] = []
    seq = 0
    for req in requests:
        heapq.heappush(events, (req.arrival_s, seq, "arrive", -1, req))
        seq += 1
    ttft: list[float] = []
    hit_tokens = 0
    prompt_tokens = 0
    inflight_samples: list[float] = []

    def start(i: int, now: float, req: Request) -> None:
        nonlocal seq, hit_tokens, prompt_tokens
        engine = engines[i]
        engine.running += 1
        tokens = len(req.hashes) * BLOCK_CHARS // CHARS_PER_TOKEN + (len(req.prompt) % BLOCK_CHARS) // CHARS_PER_TOKEN
        hit = engine.hit_blocks(req.hashes) * BLOCK_CHARS // CHARS_PER_TOKEN
        engine.insert(req.hashes)
        hit_tokens += hit
        prompt_tokens += tokens
        prefill = (tokens - hit) * p.prefill_s_per_token
        ttft.append(now - req.arrival_s + prefill)
        done = now + prefill + p.output_tokens * p.decode_s_per_token
        heapq.heappush(events, (done, seq, "finish", i, None))
        seq += 1

    while events:
        now, _, kind, i, req = heapq.heappop(events)
        if kind == "arrive":
            assert req is not None
            i = route(req, engines)
            engine = engines[i]
            engine.assigned += 1
            engine.served += 1
            loads = [e.assigned for e in engines]
            inflight_samples.append(max(loads) / (sum(loads) / len(loads)))
            if engine.running < engine.slots:
                start(i, now, req)
            else:
                engine.waiting.append((now, req))
        else:
            engine = engines[i]
            engine.running -= 1
            engine.assigned -= 1
            if engine.waiting:
                _, queued = engine.waiting.popleft()
                start(i, now, queued)
    served = [e.served for e in engines]
    ttft.sort()
    return {
        "hit_rate": hit_tokens / prompt_tokens,
        "imbalance_served": max(served) / statistics.mean(served),
        "imbalance_inflight": statistics.mean(inflight_samples),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
    }


def make_trace(name: str, p: Params) -> list[Request]:
    rng = random.Random(p.seed)
    prompts = WORKLOADS[name](rng, p.requests)
    # Offered load: a fraction of what the fleet serves when nothing is cached.
    mean_tokens = statistics.mean(len(x) for x in prompts) / CHARS_PER_TOKEN
    service_s = mean_tokens * p.prefill_s_per_token + p.output_tokens * p.decode_s_per_token
    rate = p.utilisation * p.replicas * p.slots / service_s
    t = 0.0
    out = []
    for prompt in prompts:
        t += rng.expovariate(rate)
        out.append(Request(t, prompt, block_hashes(prompt, model=MODEL, block_chars=BLOCK_CHARS, max_blocks=2048)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--cache-blocks", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--utilisation", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bound", type=float, default=1.25, help="kvfleet's loadImbalanceBound")
    parser.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    p = Params(
        replicas=args.replicas,
        requests=args.requests,
        cache_blocks=args.cache_blocks,
        slots=args.slots,
        prefill_s_per_token=0.0002,
        decode_s_per_token=0.01,
        output_tokens=64,
        utilisation=args.utilisation,
        seed=args.seed,
        bound=args.bound,
    )
    strategies: dict[str, Callable[[], Router]] = {
        "round-robin": round_robin,
        "least-load": least_load,
        "sticky-hash": lambda: sticky_hash(p.replicas),
        "kvfleet": lambda: kvfleet(p.cache_blocks, p.bound),
    }
    results: dict[str, dict[str, dict[str, float]]] = {}
    started = time.monotonic()
    chosen = [w for w in WORKLOADS if not args.only or w in args.only.split(",")]
    for workload in chosen:
        trace = make_trace(workload, p)
        results[workload] = {}
        for name, factory in strategies.items():
            results[workload][name] = simulate(trace, factory(), p)
            r = results[workload][name]
            print(
                f"{workload:28s} {name:12s} hit {r['hit_rate']:.3f} imbalance {r['imbalance_served']:.2f} "
                f"(in-flight {r['imbalance_inflight']:.2f}) ttft p50 {r['ttft_p50_s'] * 1000:.0f} ms "
                f"p99 {r['ttft_p99_s'] * 1000:.0f} ms"
            )
    elapsed = time.monotonic() - started
    write(args.out, p, results, elapsed)


def goals(results: dict[str, dict[str, dict[str, float]]]) -> list[tuple[str, str, bool]]:
    out = []
    for workload, r in results.items():
        ours = r["kvfleet"]
        if workload == "nothing shared":
            ratio = ours["ttft_p50_s"] / r["least-load"]["ttft_p50_s"]
            out.append((workload, f"TTFT p50 within 5% of least-load: {ratio:.3f}x", ratio <= 1.05))
            continue
        hit = ours["hit_rate"] / r["sticky-hash"]["hit_rate"]
        out.append((workload, f"hit rate {hit:.2f} of sticky hashing's (goal >= 0.90)", hit >= 0.9))
        out.append(
            (
                workload,
                f"imbalance {ours['imbalance_served']:.2f} (goal <= 1.25)",
                ours["imbalance_served"] <= 1.25,
            )
        )
        speedup = r["round-robin"]["ttft_p50_s"] / ours["ttft_p50_s"]
        out.append((workload, f"TTFT p50 {speedup:.1f}x better than round-robin (goal >= 2)", speedup >= 2))
        mean_speedup = r["round-robin"]["ttft_mean_s"] / ours["ttft_mean_s"]
        out.append((workload, f"(context) TTFT mean {mean_speedup:.1f}x better than round-robin", mean_speedup >= 2))
    return out


def write(out: Path, p: Params, results: dict[str, dict[str, dict[str, float]]], elapsed_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    checks = goals(results)
    (out / "router_sim.json").write_text(
        json.dumps(
            {
                "params": p.__dict__,
                "results": results,
                "goals": [{"workload": w, "check": c, "met": m} for w, c, m in checks],
                "elapsed_s": elapsed_s,
            },
            indent=2,
        )
    )
    lines = [
        f"Simulated {p.replicas} replicas x {p.slots} slots, {p.cache_blocks} cached blocks of {BLOCK_CHARS} chars "
        f"each, {p.requests} requests per workload at {p.utilisation:.0%} of no-cache capacity (seed {p.seed}); "
        f"kvfleet with loadImbalanceBound {p.bound:g}.",
        "",
        "| workload | strategy | prefix hit rate | imbalance (max/mean served) | in-flight max/mean | "
        "TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | TTFT mean (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, r in results.items():
        for name, m in r.items():
            lines.append(
                f"| {workload} | {name} | {m['hit_rate']:.3f} | {m['imbalance_served']:.2f} | "
                f"{m['imbalance_inflight']:.2f} | {m['ttft_p50_s'] * 1000:.0f} | {m['ttft_p90_s'] * 1000:.0f} | "
                f"{m['ttft_p99_s'] * 1000:.0f} | {m['ttft_mean_s'] * 1000:.0f} |"
            )
    lines += ["", "| workload | goal | met |", "|---|---|---|"]
    lines += [f"| {w} | {c} | {'yes' if m else 'NO'} |" for w, c, m in checks]
    (out / "router_sim.md").write_text("\n".join(lines) + "\n")
    plot(out / "router_sim.png", results)
    print("\n".join(lines))


def plot(path: Path, results: dict[str, dict[str, dict[str, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results)
    strategies = list(next(iter(results.values())))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = [
        ("hit_rate", "prefix hit rate"),
        ("imbalance_served", "load imbalance (max/mean)"),
        ("ttft_p50_s", "TTFT p50 (s)"),
    ]
    width = 0.8 / len(strategies)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for j, s in enumerate(strategies):
            ax.bar(
                [i + j * width for i in range(len(workloads))], [results[w][s][key] for w in workloads], width, label=s
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
        ax.set_xticklabels([w.replace(" ", "\n", 1) for w in workloads], fontsize=8)
        ax.set_title(title)
        if key.startswith("ttft"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
