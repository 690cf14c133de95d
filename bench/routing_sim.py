"""Trace-driven simulation of routing strategies over N engine replicas.

Each replica is modelled as an engine with an exact LRU prefix cache (block hashes, tails evicted
first, as vLLM frees them) and a queue; a request's modelled TTFT is its wait in the queue plus the
prefill of its uncached tokens. The strategies are round-robin, least-load (fewest in flight, the
classic baseline), sticky consistent hashing (no load bound, like KubeAI's CHWBL without its bound),
and kvfleet's own pickers -- the real ``kvfleet.router.picking`` code, not a copy -- given what the
router knows: each replica's in-flight count and its count of requests awaiting their first byte
(queued or prefilling). ``kvfleet``'s prefix strategy is also run with that waiting count replaced
by the in-flight count (``kvfleet (in-flight signal)``), which is exactly the picker before the
waiting signal existed.

Every workload also gets its lower bound, ``ideal``: each request's TTFT if the fleet were one
replica with an infinite prefix cache and no queue (the prefill of its tokens after the leading
blocks some earlier request brought). No router can beat it in this model; the run asserts that.

A second scenario, the join (``--join``, on by default for the h100 variant): one replica is absent
until the middle of the measured window and then joins empty while the others are loaded; it
reports how the arrivals of the next seconds spread and what that does to TTFT.

With ``--routers N`` the h100 variant runs 1 and N routers per strategy, and router 0 restarting halfway
through: with KV events, its views of the engines' caches start with what each engine's replay buffer
still holds (``Replay``, ``ReplayedCacheIndex``; the engines number their event batches as vLLM does,
counted conservatively: ``EVENT_STEP_S``), or empty without replay.

Two variants, both reported (docs/benchmarks/router.md section 1 says why each exists):

- ``h100``: replicas are Llama-3.1-8B on one H100 80GB: the KV cache size is derived from the model
  and the GPU (below), prefill is compute-bound and served in arrival order, and each shared-prefix
  workload's working set is sized to exceed one replica's cache but fit the fleet's.
- ``small``: the earlier configuration (2048 blocks of 128 chars, ~64k tokens per replica; small
  workloads that mostly fit one replica), the regime where every strategy already hits.

    .venv/bin/python bench/routing_sim.py                # both variants and the join, ~70 s
    .venv/bin/python bench/routing_sim.py --variant h100 --requests 30000 --replicas 16

Writes docs/benchmarks/router_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import itertools
import json
import random
import statistics
import string
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvfleet.router.peer_load import PeerLoads
from kvfleet.router.picking import Candidate, PickRequest, build_strategy
from kvfleet.router.placement import BranchIndex, home
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import block_hashes
from kvfleet.spec import RoutingSpec

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
BLOCK_CHARS = 128
CHARS_PER_TOKEN = 4
BLOCK_TOKENS = BLOCK_CHARS // CHARS_PER_TOKEN
MODEL = "sim"
LOAD_PENALTY_BLOCKS = 4.0  # RouterSettings.load_penalty_blocks' default
PLACEMENT_BRANCH_ENTRIES = 65_536  # RouterSettings.placement_branch_entries' default
PLACEMENT_MAX_DEPTH_BLOCKS = 512  # RouterSettings.placement_max_depth_blocks' default
LOAD_BOUND_SLACK = 2  # RouterSettings.load_bound_slack_requests' default

# -- the h100 variant's replica: Llama-3.1-8B BF16 on one H100 SXM 80GB under vLLM ---------------
# The same figures as docs/benchmarks/autoscaler.md. KV per token: 32 layers x 8 KV heads x 128 head
# dim x 2 (K and V) x 2 bytes = 128 KiB. vLLM gives the KV cache gpu_memory_utilization (0.9, its
# default) of the GPU minus the weights (8.03B parameters x 2 bytes): (72 GB - 16.06 GB) / 128 KiB
# = ~427k tokens. Prefill is compute-bound: 2 x 8B FLOP per token at ~50% of the H100's 989 dense
# BF16 TFLOPS = ~30k tokens/s. Decode steps take ~7 ms + 0.05 ms per running sequence, ~10 ms at
# the ~50-60 sequences a replica runs here; 200 output tokens per request.
H100_BYTES = 80e9
GPU_MEMORY_UTILISATION = 0.9
WEIGHT_BYTES = 8.03e9 * 2
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
H100_KV_TOKENS = int((H100_BYTES * GPU_MEMORY_UTILISATION - WEIGHT_BYTES) / KV_BYTES_PER_TOKEN)
H100_PREFILL_TOKENS_PER_S = 30_000


@dataclass(frozen=True)
class EngineModel:
    """How one replica serves: ``slots`` requests at once; a slot is held for prefill, or prefill and decode."""

    cache_blocks: int
    slots: int
    decode_holds_slot: bool  # False: decode runs beside later prefills (vLLM's continuous batching)
    prefill_s_per_token: float
    decode_s_per_token: float
    output_tokens: int

    def slot_s(self, prompt_tokens: float) -> float:
        """How long one request holds a slot when nothing is cached."""
        prefill = prompt_tokens * self.prefill_s_per_token
        return prefill + (self.output_tokens * self.decode_s_per_token if self.decode_holds_slot else 0.0)


H100_ENGINE = EngineModel(
    cache_blocks=H100_KV_TOKENS // BLOCK_TOKENS,
    # Prefill is compute-bound: one at a time at the GPU's full rate (chunked prefill interleaves
    # several, but their total rate is the same and vLLM schedules them first come, first served).
    slots=1,
    decode_holds_slot=False,
    prefill_s_per_token=1 / H100_PREFILL_TOKENS_PER_S,
    decode_s_per_token=0.010,
    output_tokens=200,
)
SMALL_ENGINE = EngineModel(
    cache_blocks=2048,  # ~64k tokens: the earlier configuration, kept as the small-working-set variant
    slots=8,
    decode_holds_slot=True,
    prefill_s_per_token=0.0002,
    decode_s_per_token=0.01,
    output_tokens=64,
)


@dataclass(frozen=True)
class Params:
    variant: str
    replicas: int
    requests: int
    warmup_requests: int  # served but not measured: caches start empty
    engine: EngineModel
    utilisation: float  # offered load as a fraction of the fleet's capacity with no cache hits
    seed: int
    bound: float  # kvfleet's loadImbalanceBound
    load_penalty_blocks: float


@dataclass
class Request:
    arrival_s: float
    chars: int
    key: str  # what sticky hashing hashes
    hashes: list[int] = field(default_factory=list)


# -- workloads --------------------------------------------------------------------------------------
# A workload makes (prompt, affinity key) pairs. The small variant's generators are the earlier ones,
# unchanged (their sticky key is the prompt's first two blocks); the h100 ones give the key an
# application would send in a session header (tenant, conversation, document), the strongest form of
# sticky hashing.

Workload = Callable[[random.Random, int], list[tuple[str, str]]]


def words(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def text(rng: random.Random, n_chars: int) -> str:
    """Random text, faster than ``words`` for the h100 variant's long prompts."""
    letters = rng.choices(string.ascii_lowercase + " ", k=n_chars)
    return "".join(letters)


def zipf_choice(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights)[0]


def zipf_sampler(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    cum: list[float] = []
    total = 0.0
    for i in range(n):
        total += 1 / (i + 1) ** s
        cum.append(total)
    return lambda: bisect.bisect(cum, rng.random() * total)


def by_prefix(prompts: list[str]) -> list[tuple[str, str]]:
    return [(x, x[: 2 * BLOCK_CHARS]) for x in prompts]


def multi_tenant(rng: random.Random, n: int) -> list[tuple[str, str]]:
    # 128 tenants' system prompts (~2000 tokens each) are ~4x one replica's cache but fit the fleet's.
    tenants = [f"[tenant {t}] " + words(rng, 8000) for t in range(128)]
    return by_prefix([tenants[zipf_choice(rng, 128)] + "\nUser: " + words(rng, 400) for _ in range(n)])


def multi_turn_chat(rng: random.Random, n: int) -> list[tuple[str, str]]:
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
    return by_prefix(prompts)


def rag(rng: random.Random, n: int) -> list[tuple[str, str]]:
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
    return by_prefix(prompts)


def nothing_shared(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return by_prefix([f"{i} " + words(rng, rng.randint(2000, 9000)) for i in range(n)])


# The h100 variant's sizes follow one rule, fixed before any run: each shared-prefix workload's
# working set is ~5-6x one replica's KV cache (~427k tokens) and ~0.6-0.75x the 8-replica fleet's
# (~3.4M tokens) -- too big for any one replica, small enough for the fleet if each replica holds its
# own share, the regime prefix-aware routing exists for. docs/benchmarks/router.md gives the sources.
T = CHARS_PER_TOKEN


def multi_tenant_h100(rng: random.Random, n: int) -> list[tuple[str, str]]:
    # 800 tenants (apps / agents) with system prompts of 1k-5k tokens (instructions, tool schemas,
    # few-shot examples; providers' prompt caches start at 1024 tokens), Zipf(1.0) popularity:
    # ~2.4M tokens of system prompts. User messages 50-300 tokens.
    tenants = [f"[tenant {t}] " + text(rng, rng.randint(1000, 5000) * T) for t in range(800)]
    tenant = zipf_sampler(rng, len(tenants), 1.0)
    out = []
    for _ in range(n):
        t = tenant()
        out.append((tenants[t] + "\nUser: " + text(rng, rng.randint(50, 300) * T), f"tenant-{t}"))
    return out


def multi_turn_chat_h100(rng: random.Random, n: int) -> list[tuple[str, str]]:
    # A 500-token system prompt shared by all; turns of a 100-token user message and a 300-token
    # reply; a conversation ends after each turn with probability 0.15 (~6.7 turns) or at 8k tokens.
    # 1000 conversations open at once, ~1.9k tokens each on average: ~1.9M tokens of histories (at
    # this variant's ~100 req/s a user sends the next turn ~10 s after the last: quick, like agents).
    system = "You are a helpful assistant. " + text(rng, 500 * T)
    sessions: dict[int, str] = {}
    prompts: list[tuple[str, str]] = []
    next_id = 0
    for _ in range(n):
        while len(sessions) < 1000:
            sessions[next_id] = system + "\nUser: " + text(rng, 100 * T)
            next_id += 1
        s = rng.choice(list(sessions))
        prompts.append((sessions[s], f"conversation-{s}"))
        sessions[s] += "\nAssistant: " + text(rng, 300 * T) + "\nUser: " + text(rng, 100 * T)
        if rng.random() < 0.15 or len(sessions[s]) > 8000 * T:
            del sessions[s]
    return prompts


def rag_h100(rng: random.Random, n: int) -> list[tuple[str, str]]:
    # Questions over a shared corpus of 500 documents of 2k-8k tokens (~2.5M tokens), one retrieved
    # document per request placed right after a short shared instruction (only a prompt's leading
    # blocks can be shared, so cache-friendly RAG puts the document first); document popularity
    # Zipf(0.8), the skew measured for web documents (Breslau et al., INFOCOM 1999: 0.64-0.83).
    # Questions 20-100 tokens.
    system = "Answer from the document below. " + text(rng, 50 * T)
    docs = [f"<doc {d}> " + text(rng, rng.randint(2000, 8000) * T) for d in range(500)]
    doc = zipf_sampler(rng, len(docs), 0.8)
    out = []
    for _ in range(n):
        d = doc()
        out.append((system + docs[d] + "\nQuestion: " + text(rng, rng.randint(20, 100) * T), f"doc-{d}"))
    return out


def nothing_shared_h100(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return [(x, x[: 2 * BLOCK_CHARS]) for x in (f"{i} " + text(rng, rng.randint(500, 2250) * T) for i in range(n))]


WORKLOADS: dict[str, dict[str, Workload]] = {
    "h100": {
        "multi-tenant system prompts": multi_tenant_h100,
        "multi-turn chat": multi_turn_chat_h100,
        "RAG over shared documents": rag_h100,
        "nothing shared": nothing_shared_h100,
    },
    "small": {
        "multi-tenant system prompts": multi_tenant,
        "multi-turn chat": multi_turn_chat,
        "RAG over shared documents": rag,
        "nothing shared": nothing_shared,
    },
}
DEFAULT_REQUESTS = {"h100": (12_000, 4_000), "small": (4_000, 0)}  # (requests, of which warm-up)

# -- KV-cache event batches: what a router that restarts can replay ------------------------------------
# vLLM publishes one event batch per engine step that has events, numbered from 0, and keeps the last
# ``buffer_steps`` (10,000 by default) for its replay socket. It caches full blocks of generated tokens
# too (``allocate_slots`` caches up to ``request.num_tokens``): with n sequences decoding a step fills a
# 16-token block with probability 1 - (15/16)^n, ~50% at the ~10 a replica decodes here in RAG, ~90% at
# the ~35 in nothing shared. The simulator does not model decode steps, so it counts them by time,
# conservatively (more batches: a shorter horizon in the buffer, worse for replay): one batch every
# ``EVENT_STEP_S``, the model's fastest decode step (7 ms with nothing else in the batch), from the
# engine's start, plus one per prefill that stores blocks and one per prefill that evicts some, as if
# neither ever shared a step.
EVENT_STEP_S = 0.007
VLLM_BUFFER_STEPS = 10_000  # vLLM's ``ZmqEventPublisher`` default ``buffer_steps``


# -- replicas ---------------------------------------------------------------------------------------


class Engine:
    """An engine replica: an exact LRU prefix cache, ``slots`` requests served at once, a FIFO queue.

    Each cached block maps to the number of the event batch that last stored it: a block that is hit is
    not stored again (unless ``report_hits``), so a prefix that stays cached keeps its first number.
    """

    def __init__(self, cache_blocks: int, slots: int) -> None:
        self.cache: OrderedDict[int, int] = OrderedDict()
        self.event_batches = 0  # batches of prefill stores and evictions; the decode steps' are counted by time
        self.parent: dict[int, int | None] = {}  # cached block -> the block before it in its chain (None: first)
        # vLLM's per-request ``kv_cache_report_mode: "full"``: a prefill's BlockStored also names the cached
        # blocks it hit, so a prefix that stays cached is announced again each time it is used
        self.report_hits = False
        self.capacity = cache_blocks
        self.slots = slots
        self.running = 0
        self.waiting: deque[tuple[float, Request, Load, bool]] = deque()
        self.assigned = 0  # queued + running + decoding: the in-flight count the router sees
        self.unanswered = 0  # queued + prefilling (no first token yet): the router's waiting count
        self.served = 0

    def hit_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def published(self, now: float) -> int:
        """How many event batches the engine has published by ``now`` (see ``EVENT_STEP_S``)."""
        return int(now / EVENT_STEP_S) + self.event_batches

    def insert(self, hashes: list[int], now: float = 0.0) -> None:
        cache, parent = self.cache, self.parent
        batch = -1  # the number of this prefill's store batch, once it stores a block
        report_hits = self.report_hits
        for j in range(len(hashes) - 1, -1, -1):
            h = hashes[j]
            held = h in cache
            if held:
                cache.move_to_end(h)
                if not report_hits:
                    continue
            if batch < 0:
                self.event_batches += 1
                batch = self.published(now) - 1
            cache[h] = batch  # a held block keeps its place: move_to_end above set it
            if not held:
                parent[h] = hashes[j - 1] if j else None
        if len(cache) > self.capacity:
            self.event_batches += 1  # the eviction's BlockRemoved, counted as a batch of its own
            while len(cache) > self.capacity:
                del parent[cache.popitem(last=False)[0]]

    def chained_from(self, first: int) -> int:
        """How many cached blocks a view that received batches from ``first`` on can use: those stored in
        them whose every ancestor was too (``CacheView`` skips a block whose parent it does not hold)."""
        cache, parent = self.cache, self.parent
        usable: dict[int, bool] = {}
        for h in cache:
            path = []
            node: int | None = h
            while node is not None and node not in usable:
                path.append(node)
                node = parent.get(node) if node in cache else None
            ok = usable.get(node, True) if node is not None else True
            for b in reversed(path):
                ok = ok and b in cache and cache[b] >= first
                usable[b] = ok
        return sum(1 for ok in usable.values() if ok)


# -- strategies -------------------------------------------------------------------------------------


class Load:
    """One replica as one router sees it: its in-flight count and its count awaiting a first byte."""

    __slots__ = ("assigned", "unanswered")

    def __init__(self, assigned: int = 0, unanswered: int = 0) -> None:
        self.assigned = assigned
        self.unanswered = unanswered


# A router: given a request and the present replicas' loads as this router sees them, the replica's index.
Router = Callable[[Request, list[Load]], int]
# Builds a router; the engines are for the router that reads the engines' exact caches (KV events).
RouterFactory = Callable[[list[Engine]], Router]


def round_robin() -> Router:
    turn = [0]

    def route(req: Request, engines: list[Load]) -> int:
        turn[0] += 1
        return turn[0] % len(engines)

    return route


def least_load() -> Router:
    turn = [0]

    def route(req: Request, engines: list[Load]) -> int:
        least = min(e.assigned for e in engines)
        tied = [i for i, e in enumerate(engines) if e.assigned == least]
        turn[0] += 1
        return tied[turn[0] % len(tied)]

    return route


def sticky_hash(n_replicas: int, vnodes: int = 100) -> Router:
    ring = sorted(
        (int.from_bytes(hashlib.blake2b(f"{r}-{v}".encode(), digest_size=8).digest(), "big"), r)
        for r in range(n_replicas)
        for v in range(vnodes)
    )
    points = [p for p, _ in ring]

    def route(req: Request, engines: list[Load]) -> int:
        h = int.from_bytes(hashlib.blake2b(req.key.encode(), digest_size=8).digest(), "big")
        return ring[bisect.bisect(points, h) % len(ring)][1]

    return route


class EngineCacheIndex(PrefixIndex):
    """The prefix index a router subscribed to every engine's KV-cache events would hold: the engines'
    exact cache contents (evictions included), with no delay. The moonshot's reference."""

    def __init__(self, engines: list[Engine]) -> None:
        super().__init__(1)
        self._engines = engines

    def matched_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        return self._engines[int(replica_id)].hit_blocks(hashes)

    def held_anywhere(self, block_hash: int) -> bool:
        return any(block_hash in e.cache for e in self._engines)

    def record(self, replica_id: str, hashes: Sequence[int]) -> None:
        pass  # the engines' events say what they hold; a pick teaches nothing


@dataclass(frozen=True)
class Replay:
    """What a router that (re)starts with KV events receives of each engine's past batches.

    ``buffer_steps``: the publisher's replay buffer, in batches (vLLM's ``buffer_steps``): the router asks
    from batch 0 and gets every batch still buffered. None: no replay, only the batches published from
    now on (a plain subscription to the PUB socket).
    """

    buffer_steps: int | None
    report_hits: bool = False  # every router asks for ``kv_cache_report_mode: "full"`` (``Engine.report_hits``)

    def first_batch(self, published: int) -> int:
        """The first batch number the new view receives, of ``published`` so far; 0: the view is complete."""
        if self.buffer_steps is None:
            return published
        return max(0, published - self.buffer_steps)


class ReplayedCacheIndex(PrefixIndex):
    """The index of a router that (re)started with KV events: per engine, the view its subscription
    rebuilt (``Replay``) and kept since, scored as ``kvfleet.router.engine_caches.EngineCaches.matched``
    scores it; the ``PrefixIndex`` it extends is the router's own learned index, new and empty.

    ``first[i]``: the first batch number engine ``i``'s view received. The view holds the engine's cached
    blocks last stored in that batch or later (every later batch is received: new stores and evictions
    tracked exactly, as the other routers' views). With ``first[i] == 0`` the view is complete, the
    truth; otherwise it lacks what was stored earlier and is still cached, so the larger of its match and
    the learned index's counts. ``held_anywhere`` is the learned index's or any view's, as the queue scorer
    asks both (``picking.QueueScorer``).
    """

    def __init__(self, cache_blocks: int, engines: list[Engine], first: list[int]) -> None:
        super().__init__(cache_blocks)
        self._engines = engines
        self._first = first

    def view_matched(self, i: int, hashes: Sequence[int]) -> int:
        """The leading blocks of the prompt engine ``i``'s view holds."""
        first = self._first[i]
        cache = self._engines[i].cache
        n = 0
        for h in hashes:
            batch = cache.get(h)
            if batch is None or batch < first:
                break
            n += 1
        return n

    def view_holds(self, i: int, block_hash: int) -> bool:
        batch = self._engines[i].cache.get(block_hash)
        return batch is not None and batch >= self._first[i]

    def matched_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        i = int(replica_id)
        held = self.view_matched(i, hashes)
        return held if self._first[i] == 0 else max(held, super().matched_blocks(replica_id, hashes))

    def held_anywhere(self, block_hash: int) -> bool:
        if super().held_anywhere(block_hash):
            return True
        return any(self.view_holds(i, block_hash) for i in range(len(self._engines)))


def kvfleet(
    cache_blocks: int,
    bound: float,
    load_penalty_blocks: float,
    *,
    strategy_name: str = "prefix",
    waiting: bool = True,
    placement: bool = False,
    slack: int = 0,
    engines: list[Engine] | None = None,
    replayed_from: list[int] | None = None,
) -> Router:
    """kvfleet's picker; ``waiting=False`` feeds it the in-flight count as the waiting count (the old picker).

    ``placement``: the rendezvous home over the prompt's divergence block (``kvfleet.router.placement``).
    ``slack``: requests allowed over the load bound's cap. The defaults are the picker as section 1 of
    docs/benchmarks/router.md measured it; the router's defaults now are ``placement=True, slack=2``.
    ``engines``: the index is the engines' exact caches (``EngineCacheIndex``), as KV events would give.
    ``replayed_from``: with ``engines``, a router that (re)started: per engine, the first batch number its
    view received (``ReplayedCacheIndex``).
    """
    index: PrefixIndex
    if engines is None:
        index = PrefixIndex(cache_blocks)
    elif replayed_from is None:
        index = EngineCacheIndex(engines)
    else:
        index = ReplayedCacheIndex(cache_blocks, engines, replayed_from)
    routing = RoutingSpec(prefix_block_chars=BLOCK_CHARS, load_imbalance_bound=bound, strategy=strategy_name)
    strategy = build_strategy(
        routing, index, load_penalty_blocks=load_penalty_blocks, placement=placement, load_bound_slack=slack
    )
    branches = BranchIndex(PLACEMENT_BRANCH_ENTRIES, PLACEMENT_MAX_DEPTH_BLOCKS) if placement else None

    def route(req: Request, engines: list[Load]) -> int:
        candidates = [
            Candidate(str(i), e.assigned, waiting=e.unanswered if waiting else e.assigned)
            for i, e in enumerate(engines)
        ]
        key, block = home(branches, req.hashes) if branches is not None else (None, 0)
        pick = strategy.pick(candidates, PickRequest(req.hashes, home_key=key, home_block=block))
        assert pick is not None
        index.record(pick.replica_id, req.hashes)
        return int(pick.replica_id)

    return route


# -- simulation -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Join:
    """The last replica is absent until ``at_s`` and then joins empty; measured over ``window_s`` after."""

    at_s: float
    window_s: float
    slo_s: float  # a TTFT miss: autoscale_sim's first TTFT SLO (1 s)


def request_tokens(req: Request) -> int:
    """A prompt's tokens: its whole blocks (the cacheable part) and the partial tail (never cached)."""
    return len(req.hashes) * BLOCK_TOKENS + (req.chars % BLOCK_CHARS) // CHARS_PER_TOKEN


def prefill_s(m: EngineModel, tokens: int, hit_tokens: int) -> float:
    """Prefill of the uncached tokens; the same in both variants (slots only decide when it starts)."""
    return (tokens - hit_tokens) * m.prefill_s_per_token


def measured_from_s(requests: list[Request], p: Params) -> float:
    """Requests arriving from here on are measured; the earlier ones only warm the caches."""
    return requests[p.warmup_requests].arrival_s


def ideal(requests: list[Request], p: Params) -> dict[str, float]:
    """The TTFT no router can beat on this trace and engine model: one replica, infinite cache, no queue.

    A request's prefix hit on any replica is at most its leading blocks that some earlier request
    brought (a replica caches only what it has started, and it starts its requests in arrival order),
    its wait is at least zero, and prefill is linear in the uncached tokens; so each request's
    figure here is <= its TTFT under every strategy, and so are the percentiles over the same
    measured requests. ``check_bound`` asserts that on every run.

    ``granular_*``: the same with a further ``BLOCK_TOKENS`` tokens cached per request, what an engine
    that cached any shared prefix to the token (not only whole blocks) could save at most. Outside
    this model, so not asserted; the goals' "infeasible" verdict uses it, so that the block size
    cannot be what makes a goal infeasible.
    """
    m = p.engine
    seen: set[int] = set()  # every block any earlier request brought, never evicted
    from_s = measured_from_s(requests, p)
    ttft: list[float] = []
    granular: list[float] = []
    hit_tokens = 0
    prompt_tokens = 0
    for req in requests:
        hit_blocks = 0
        for h in req.hashes:
            if h not in seen:
                break
            hit_blocks += 1
        seen.update(req.hashes)
        if req.arrival_s >= from_s:
            tokens = request_tokens(req)
            hit = hit_blocks * BLOCK_TOKENS
            hit_tokens += hit
            prompt_tokens += tokens
            ttft.append(prefill_s(m, tokens, hit))
            granular.append(prefill_s(m, tokens, min(tokens, hit + BLOCK_TOKENS)))
    ttft.sort()
    granular.sort()
    g = ttft_summary(granular)
    return {
        "hit_rate": hit_tokens / prompt_tokens,
        **ttft_summary(ttft),
        "granular_ttft_p50_s": g["ttft_p50_s"],
        "granular_ttft_p99_s": g["ttft_p99_s"],
    }


def ttft_summary(ttft: list[float]) -> dict[str, float]:
    """p50 / mean / p90 / p99 of sorted TTFTs, the same indexing for every strategy and the bound."""
    return {
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
    }


def check_bound(workload: str, bound: dict[str, float], results: dict[str, dict[str, float]]) -> None:
    """Fail the run if any strategy beats the ideal: that would be a bug in the bound (or the simulator)."""
    for name, r in results.items():
        for key in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s"):
            if r[key] < bound[key]:
                raise AssertionError(f"{workload}: {name}'s {key} {r[key]} is below the ideal's {bound[key]}")
        if r["hit_rate"] > bound["hit_rate"]:
            raise AssertionError(f"{workload}: {name}'s hit rate {r['hit_rate']} is above the ideal's")


@dataclass(frozen=True)
class Restart:
    """Router 0 restarts at ``at_s``: a new process with an empty index and no in-flight view of its own."""

    at_s: float
    windows_s: tuple[float, ...] = (0.0, 2.0, 5.0, 10.0, 20.0)  # reported per window after the restart
    # The new process, built from the engines and the time of the restart (what a replay still holds then),
    # with figures about its start to report; None: built as the other routers are, from nothing.
    factory: Callable[[list[Engine], float], tuple[Router, dict[str, float]]] | None = None
    spans_s: tuple[tuple[float, float], ...] = ()  # further windows reported, e.g. the first 10 s as one
    engines_report_hits: bool = False  # from the start (``Engine.report_hits``)


@dataclass(frozen=True)
class Fleet:
    """How many routers, and what each knows of the engines' load.

    ``routers``: each has its own state and its own in-flight view; each request goes to one at random,
    as a Service spreads connections. ``shared_load_s``: every this many seconds each router reads
    every engine's own counts (``vllm:num_requests_running`` + ``_waiting``, and requests not yet
    past prefill), and between reads adds what it sent and saw finish since; None: its own counts only.
    ``peer_latency_s``: the routers report their own counts to each other (``PeerLoads``) instead.
    """

    routers: int = 1
    shared_load_s: float | None = None
    # ``shared_load_s`` refinements: each router reads at its own phase (not all at once), and adds its own
    # sends and completions since the read times this (the routers' count: the others likely did the same).
    shared_load_staggered: bool = False
    shared_load_own_x: float = 1.0
    # None: no peer reports. Else each router's count changes reach the other routers this many seconds
    # later (``kvfleet.router.peer_load``), and each picks on its own counts plus the peers' reported ones.
    peer_latency_s: float | None = None


def simulate(
    requests: list[Request],
    factory: RouterFactory,
    p: Params,
    join: Join | None = None,
    fleet: Fleet = Fleet(),
    restart: Restart | None = None,
) -> dict[str, float]:
    """Replay the trace; requests before ``p.warmup_requests`` warm the caches and are not measured.

    With ``join`` only the requests arriving in the join window are measured, and the figures about
    the joining replica (``joined_*``) are added. With ``restart``, per-window figures for the requests
    the restarted router routed and for the others' (``restart``) are added.
    """
    m = p.engine
    engines = [Engine(m.cache_blocks, m.slots) for _ in range(p.replicas)]
    for e in engines:
        e.report_hits = restart is not None and restart.engines_report_hits
    joined = engines[-1]
    routers = [factory(engines) for _ in range(fleet.routers)]
    # Each router's own view: per replica, what it sent and has not seen finish / answer. A restarted
    # router gets new lists; requests its old process sent still finish against the old ones.
    own = [[Load() for _ in engines] for _ in routers]
    base = [[Load() for _ in engines] for _ in routers]  # own counts at the last shared read
    shared = [Load() for _ in engines]  # the engines' counts at the last shared read
    next_read_s = 0.0
    # staggered reads: each router's own copy of the engines' counts, read at its own phase
    shared_by = [[Load() for _ in engines] for _ in routers]
    next_read_by = [fleet.shared_load_s * r / len(routers) if fleet.shared_load_s else 0.0 for r in range(len(routers))]
    # Peer reports: each router's real PeerLoads, fed each change of another router's own counts after
    # ``peer_latency_s``; the reporter is the Load list (a restarted router reports under a new name).
    peer_loads = [PeerLoads() for _ in routers]
    reporters: dict[int, tuple[str, list[Load]]] = {}  # id(Load) -> (peer name, its router's list)
    report_seq = itertools.count()
    spread = random.Random(p.seed + 7919)  # which router each request reaches
    # (time, seq, kind, replica, payload): "arrive" (payload: the request); "first" ends a prefill (the
    # first token); "slot" frees a slot; "finish" ends the request ("first"/"finish": its router's Load)
    events: list[tuple[float, int, str, int, object]] = []
    seq = 0
    for req in requests:
        heapq.heappush(events, (req.arrival_s, seq, "arrive", -1, req))
        seq += 1
    from_s = measured_from_s(requests, p) if join is None else join.at_s
    to_s = float("inf") if join is None else join.at_s + join.window_s
    ttft: list[float] = []
    hit_tokens = 0
    prompt_tokens = 0
    inflight_samples: list[float] = []
    served = [0] * p.replicas
    first_second = 0  # arrivals in the join's first second, and how many went to the joining replica
    first_second_joined = 0
    joined_peak_waiting = 0
    restarted = False
    at_restart: dict[str, float] = {}
    # per measured request around the restart: (arrival after the restart, restarted router?, ttft, hit, tokens)
    around: list[tuple[float, bool, float, int, int]] = []

    def measured(arrival_s: float) -> bool:
        return from_s <= arrival_s < to_s

    def report(now: float, i: int, view: Load) -> None:
        nonlocal seq
        if fleet.peer_latency_s is None:
            return
        name, source = reporters[id(view)]
        payload = (name, next(report_seq), i, view.assigned, view.unanswered, source)
        heapq.heappush(events, (now + fleet.peer_latency_s, seq, "report", i, payload))
        seq += 1

    def start(i: int, now: float, req: Request, view: Load, by_restarted: bool) -> None:
        nonlocal seq, hit_tokens, prompt_tokens
        engine = engines[i]
        engine.running += 1
        tokens = request_tokens(req)
        hit = engine.hit_blocks(req.hashes) * BLOCK_TOKENS
        engine.insert(req.hashes, now)
        prefill = prefill_s(m, tokens, hit)
        if measured(req.arrival_s):
            hit_tokens += hit
            prompt_tokens += tokens
            ttft.append(now - req.arrival_s + prefill)
        if restart is not None and req.arrival_s >= restart.at_s:
            around.append((req.arrival_s - restart.at_s, by_restarted, now - req.arrival_s + prefill, hit, tokens))
        done = now + prefill + m.output_tokens * m.decode_s_per_token
        heapq.heappush(events, (now + prefill, seq, "first", i, view))
        heapq.heappush(events, (done if m.decode_holds_slot else now + prefill, seq + 1, "slot", i, None))
        heapq.heappush(events, (done, seq + 2, "finish", i, view))
        seq += 3

    while events:
        now, _, kind, i, payload = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(payload, Request)
            req = payload
            if restart is not None and not restarted and now >= restart.at_s:
                restarted = True
                if restart.factory is None:
                    routers[0] = factory(engines)
                else:
                    routers[0], at_restart = restart.factory(engines, now)
                peer_loads[0] = PeerLoads()
                own[0] = [Load() for _ in engines]
                base[0] = [Load() for _ in engines]
            r = spread.randrange(len(routers)) if len(routers) > 1 else 0
            n_present = len(engines) if join is None or now >= join.at_s else len(engines) - 1
            mine = own[r]
            if fleet.peer_latency_s is not None:
                merged = peer_loads[r].add_to(
                    [Candidate(str(k), v.assigned, waiting=v.unanswered) for k, v in enumerate(mine[:n_present])], now
                )
                loads = [Load(c.inflight, c.waiting) for c in merged]
            elif fleet.shared_load_s is None:
                loads = mine[:n_present]
            elif fleet.shared_load_staggered:
                at, seen = base[r], shared_by[r]
                if now >= next_read_by[r]:
                    next_read_by[r] = now + fleet.shared_load_s
                    for e, sv, ov, bv in zip(engines, seen, mine, at, strict=True):
                        sv.assigned, sv.unanswered = e.assigned, e.unanswered
                        bv.assigned, bv.unanswered = ov.assigned, ov.unanswered
                x = fleet.shared_load_own_x
                loads = [
                    Load(
                        max(mine[k].assigned, round(seen[k].assigned + x * (mine[k].assigned - at[k].assigned))),
                        max(
                            mine[k].unanswered, round(seen[k].unanswered + x * (mine[k].unanswered - at[k].unanswered))
                        ),
                    )
                    for k in range(n_present)
                ]
            else:
                if now >= next_read_s:
                    next_read_s = now + fleet.shared_load_s
                    for e, view in zip(engines, shared, strict=True):
                        view.assigned, view.unanswered = e.assigned, e.unanswered
                    for o, b in zip(own, base, strict=True):
                        for ov, bv in zip(o, b, strict=True):
                            bv.assigned, bv.unanswered = ov.assigned, ov.unanswered
                at = base[r]
                loads = [
                    Load(
                        max(0, shared[k].assigned + mine[k].assigned - at[k].assigned),
                        max(0, shared[k].unanswered + mine[k].unanswered - at[k].unanswered),
                    )
                    for k in range(n_present)
                ]
            i = routers[r](req, loads)
            engine = engines[i]
            view = mine[i]
            engine.assigned += 1
            engine.unanswered += 1
            view.assigned += 1
            view.unanswered += 1
            if id(view) not in reporters:
                reporters[id(view)] = (f"router-{r}-{id(mine)}", mine)
            report(now, i, view)
            if measured(req.arrival_s):
                served[i] += 1
                counts = [e.assigned for e in engines]
                inflight_samples.append(max(counts) / (sum(counts) / len(counts)))
            if join is not None and join.at_s <= now < join.at_s + 1.0:
                first_second += 1
                first_second_joined += engine is joined
            if engine is joined:
                joined_peak_waiting = max(joined_peak_waiting, engine.unanswered)
            by_restarted = restarted and r == 0
            if engine.running < engine.slots:
                start(i, now, req, view, by_restarted)
            else:
                engine.waiting.append((now, req, view, by_restarted))
        elif kind == "first":
            assert isinstance(payload, Load)
            engines[i].unanswered -= 1
            payload.unanswered -= 1
            report(now, i, payload)
        elif kind == "report":
            name, number, _, inflight, waiting, source = payload  # type: ignore[misc]
            for q, peers in enumerate(peer_loads):
                if own[q] is not source:
                    peers.apply(name, number, [(str(i), inflight, waiting)], now)
        elif kind == "slot":
            engine = engines[i]
            engine.running -= 1
            if engine.waiting:
                _, queued, view, by_restarted = engine.waiting.popleft()
                start(i, now, queued, view, by_restarted)
        else:
            assert isinstance(payload, Load)
            engines[i].assigned -= 1
            payload.assigned -= 1
            report(now, i, payload)
    ttft.sort()
    out = {
        "hit_rate": hit_tokens / prompt_tokens,
        "imbalance_served": max(served) / statistics.mean(served),
        "imbalance_inflight": statistics.mean(inflight_samples),
        **ttft_summary(ttft),
    }
    if join is not None:
        out["joined_share_first_s"] = first_second_joined / max(1, first_second)
        out["joined_share_window"] = served[-1] / max(1, sum(served))
        out["joined_peak_waiting"] = joined_peak_waiting
        out["ttft_misses"] = sum(1 for t in ttft if t > join.slo_s)
        out["window_requests"] = len(ttft)
    if restart is not None:
        out.update(at_restart)
        for lo, hi in [*itertools.pairwise(restart.windows_s), *restart.spans_s]:
            for who, flag in (("restarted", True), ("others", False)):
                rows = [x for x in around if lo <= x[0] < hi and x[1] is flag]
                if not rows:
                    continue
                times = sorted(x[2] for x in rows)
                tag = f"{who}_{lo:g}_{hi:g}s"
                out[f"{tag}_hit_rate"] = sum(x[3] for x in rows) / max(1, sum(x[4] for x in rows))
                out[f"{tag}_ttft_mean_s"] = statistics.mean(times)
                out[f"{tag}_ttft_p99_s"] = times[min(len(times) - 1, int(len(times) * 0.99))]
                out[f"{tag}_requests"] = len(rows)
    return out


@dataclass(frozen=True)
class TraceStats:
    rate_per_s: float
    mean_prompt_tokens: float
    reused_prompt_tokens: int  # distinct blocks that occur in two or more prompts, x block size


def make_trace(name: str, p: Params) -> tuple[list[Request], TraceStats]:
    rng = random.Random(p.seed)
    prompts = WORKLOADS[p.variant][name](rng, p.requests)
    # Offered load: a fraction of what the fleet serves when nothing is cached.
    mean_tokens = statistics.mean(len(x) for x, _ in prompts) / CHARS_PER_TOKEN
    rate = p.utilisation * p.replicas * p.engine.slots / p.engine.slot_s(mean_tokens)
    t = 0.0
    out = []
    seen: Counter[int] = Counter()
    for prompt, key in prompts:
        t += rng.expovariate(rate)
        hashes = block_hashes(prompt, model=MODEL, block_chars=BLOCK_CHARS, max_blocks=2048)
        seen.update(hashes)
        out.append(Request(t, len(prompt), key, hashes))
    reused = sum(1 for n in seen.values() if n >= 2)
    return out, TraceStats(rate, mean_tokens, reused * BLOCK_TOKENS)


Results = dict[str, dict[str, dict[str, float]]]


JOIN_WINDOW_S = 10.0
JOIN_SLO_S = 1.0


@dataclass(frozen=True)
class VariantRun:
    params: Params
    results: Results  # workload -> strategy -> figures
    stats: dict[str, TraceStats]
    joins: Results
    ideals: dict[str, dict[str, float]]  # workload -> the lower bound's figures (``ideal``)


def run_variant(p: Params, only: list[str], join: bool) -> VariantRun:
    """Every workload under every strategy and its lower bound; with ``join``, the join scenario too (not
    for sticky hashing, whose ring is fixed)."""
    strategies: dict[str, RouterFactory] = {
        "round-robin": lambda _: round_robin(),
        "least-load": lambda _: least_load(),
        "sticky-hash": lambda _: sticky_hash(p.replicas),
        "kvfleet": lambda _: kvfleet(p.engine.cache_blocks, p.bound, p.load_penalty_blocks),
        "kvfleet (in-flight signal)": lambda _: kvfleet(
            p.engine.cache_blocks, p.bound, p.load_penalty_blocks, waiting=False
        ),
        "kvfleet least-load": lambda _: kvfleet(
            p.engine.cache_blocks, p.bound, p.load_penalty_blocks, strategy_name="least-load"
        ),
    }
    results: Results = {}
    joins: Results = {}
    stats: dict[str, TraceStats] = {}
    ideals: dict[str, dict[str, float]] = {}
    for workload in [w for w in WORKLOADS[p.variant] if not only or w in only]:
        trace, stats[workload] = make_trace(workload, p)
        results[workload] = {}
        for name, factory in strategies.items():
            r = results[workload][name] = simulate(trace, factory, p)
            print(
                f"{p.variant:5s} {workload:28s} {name:26s} hit {r['hit_rate']:.3f} "
                f"imbalance {r['imbalance_served']:.2f} (in-flight {r['imbalance_inflight']:.2f}) "
                f"ttft p50 {r['ttft_p50_s'] * 1000:.0f} ms p99 {r['ttft_p99_s'] * 1000:.0f} ms",
                flush=True,
            )
        b = ideals[workload] = ideal(trace, p)
        check_bound(workload, b, results[workload])
        print(
            f"{p.variant:5s} {workload:28s} {'ideal (lower bound)':26s} hit {b['hit_rate']:.3f} "
            f"ttft p50 {b['ttft_p50_s'] * 1000:.0f} ms p99 {b['ttft_p99_s'] * 1000:.0f} ms",
            flush=True,
        )
        if not join:
            continue
        # The join comes halfway through the measured requests, long after the warm-up.
        middle = trace[p.warmup_requests + (len(trace) - p.warmup_requests) // 2].arrival_s
        scenario = Join(at_s=middle, window_s=JOIN_WINDOW_S, slo_s=JOIN_SLO_S)
        joins[workload] = {}
        for name, factory in strategies.items():
            if name == "sticky-hash":
                continue
            r = joins[workload][name] = simulate(trace, factory, p, scenario)
            print(
                f"{p.variant:5s} join {workload:23s} {name:26s} to the new replica: "
                f"{r['joined_share_first_s']:.0%} of the first second's arrivals, peak waiting "
                f"{r['joined_peak_waiting']:.0f}; ttft p99 {r['ttft_p99_s'] * 1000:.0f} ms, "
                f"{r['ttft_misses']:.0f} over {JOIN_SLO_S:g} s",
                flush=True,
            )
    return VariantRun(p, results, stats, joins, ideals)


# -- several routers -------------------------------------------------------------------------------

SHARED_LOAD_S = 0.25  # how often a router reads the engines' own load (RouterSettings.engine_load_interval_s)
RESTART_WINDOWS_S = (0.0, 2.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True)
class FleetStrategy:
    """A strategy for the several-routers comparison: how each router picks, and what load it sees."""

    factory: RouterFactory
    shared_load_s: float | None = None
    restart: bool = False  # also run the router-restart scenario
    shared_load_staggered: bool = False
    shared_load_own_x: bool = False  # own sends since the read count x the routers (``Fleet.shared_load_own_x``)
    peer_latency_s: float | None = None
    # With KV events: the router that restarts, built from the engines and, per engine, the first batch
    # number its view received (``kvfleet``'s ``replayed_from``); its restart runs under each of ``REPLAYS``.
    replayed: Callable[[list[Engine], list[int]], Router] | None = None

    def fleet(self, routers: int) -> Fleet:
        own_x = float(routers) if self.shared_load_own_x else 1.0
        return Fleet(routers, self.shared_load_s, self.shared_load_staggered, own_x, self.peer_latency_s)


def fleet_strategies(p: Params) -> dict[str, FleetStrategy]:
    c, b, w, k = p.engine.cache_blocks, p.bound, p.load_penalty_blocks, LOAD_BOUND_SLACK
    return {
        "round-robin": FleetStrategy(lambda _: round_robin()),
        "least-load": FleetStrategy(lambda _: least_load()),
        "sticky-hash": FleetStrategy(lambda _: sticky_hash(p.replicas)),
        "kvfleet before (own index, no slack)": FleetStrategy(lambda _: kvfleet(c, b, w), restart=True),
        "own index": FleetStrategy(lambda _: kvfleet(c, b, w, slack=k)),
        "own index + engine load": FleetStrategy(lambda _: kvfleet(c, b, w, slack=k), SHARED_LOAD_S),
        "placement (no slack)": FleetStrategy(lambda _: kvfleet(c, b, w, placement=True)),
        "placement": FleetStrategy(lambda _: kvfleet(c, b, w, placement=True, slack=k), restart=True),
        "placement + engine load": FleetStrategy(
            lambda _: kvfleet(c, b, w, placement=True, slack=k), SHARED_LOAD_S, restart=True
        ),
        "KV events (exact caches)": FleetStrategy(lambda e: kvfleet(c, b, w, slack=k, engines=e)),
        "KV events (exact caches) + engine load": FleetStrategy(
            lambda e: kvfleet(c, b, w, slack=k, engines=e), SHARED_LOAD_S
        ),
        # What the router runs with KV events on: the events' exact caches for where a prefix is, placement
        # for where a new family goes. Its restart: the view the new process rebuilds from each engine's
        # replay buffer (or none), then every new batch (``ReplayedCacheIndex``), under each of ``REPLAYS``.
        PLACEMENT_AND_EVENTS: FleetStrategy(
            lambda e: kvfleet(c, b, w, placement=True, slack=k, engines=e),
            replayed=lambda e, first: kvfleet(c, b, w, placement=True, slack=k, engines=e, replayed_from=first),
        ),
        # Load signals for it (the figures docs/router.md's "Several routers" weighs): the engines' own counts
        # read more often, each router at its own phase, its own sends since the read counted x the routers;
        # then the routers' own counts reported to each other (``PeerLoads``), seen 1 ms and 5 ms later.
        f"{PLACEMENT_AND_EVENTS} + engine load every {FAST_LOAD_S:g} s, staggered, own x routers": FleetStrategy(
            lambda e: kvfleet(c, b, w, placement=True, slack=k, engines=e),
            FAST_LOAD_S,
            shared_load_staggered=True,
            shared_load_own_x=True,
        ),
        PEER_LOAD_GOAL: FleetStrategy(
            lambda e: kvfleet(c, b, w, placement=True, slack=k, engines=e),
            peer_latency_s=PEER_LATENCY_S,
            replayed=lambda e, first: kvfleet(c, b, w, placement=True, slack=k, engines=e, replayed_from=first),
        ),
        f"{PLACEMENT_AND_EVENTS} + peer load ({SLOW_PEER_LATENCY_S * 1000:g} ms)": FleetStrategy(
            lambda e: kvfleet(c, b, w, placement=True, slack=k, engines=e), peer_latency_s=SLOW_PEER_LATENCY_S
        ),
        f"placement + peer load ({PEER_LATENCY_S * 1000:g} ms)": FleetStrategy(
            lambda _: kvfleet(c, b, w, placement=True, slack=k), peer_latency_s=PEER_LATENCY_S, restart=True
        ),
    }


PLACEMENT_AND_EVENTS = "placement + KV events (exact caches)"
FAST_LOAD_S = 0.05
PEER_LATENCY_S = 0.001  # a report's way from one router to another: a datagram in one cluster, batched
SLOW_PEER_LATENCY_S = 0.005
PEER_LOAD_GOAL = f"{PLACEMENT_AND_EVENTS} + peer load ({PEER_LATENCY_S * 1000:g} ms)"
# What the router runs without and with KV events, and with its peers' reported load (the goals table
# judges each).
FLEET_GOAL_STRATEGIES = ("placement", PLACEMENT_AND_EVENTS, PEER_LOAD_GOAL)
FLEET_BASELINE = "kvfleet before (own index, no slack)"  # one router of today's kvfleet: the figures to hold
# How a router restarting with KV events rebuilds its views (``Replay``). At the batch rate counted here
# (``EVENT_STEP_S``: ~150-175 batches/s per engine) vLLM's default buffer holds the last ~60 s, less than
# the ~55-210 s before each h100 trace's restart but for nothing shared's; 1,000 batches hold ~6 s; the
# first row's buffer outlasts every trace (the complete view, as a buffer counted per request would be).
REPLAYS = {
    "replay, buffer 1,000,000 batches": Replay(1_000_000),
    f"replay, buffer {VLLM_BUFFER_STEPS:,} batches (vLLM's default)": Replay(VLLM_BUFFER_STEPS),
    "replay, buffer 1,000 batches": Replay(1_000),
    "no replay (new batches only)": Replay(None),
    f"replay, buffer {VLLM_BUFFER_STEPS:,} batches, hits reported": Replay(VLLM_BUFFER_STEPS, report_hits=True),
}
REPLAY_ROW = ", restart: "  # a restart row's name: the strategy, this, the ``REPLAYS`` label
RESTART_SPANS_S = ((0.0, 10.0),)  # the replay rows' restart goal reads the first 10 s as one window too
RESTART_GOAL_HIT = 0.97  # the restarted router's hit rate against the others' in the same window


@dataclass(frozen=True)
class FleetRun:
    params: Params
    routers: int
    results: dict[str, dict[str, dict[str, dict[str, float]]]]  # workload -> strategy -> "1" / "N" -> figures
    restarts: Results  # workload -> strategy -> figures with the restart windows
    ideals: dict[str, dict[str, float]]


def run_fleet(p: Params, only: list[str], n_routers: int, strategies: Sequence[str] = ()) -> FleetRun:
    """Every workload under every strategy with one router and with ``n_routers``; then router 0 of
    ``n_routers`` restarting halfway through the measured requests."""
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    restarts: Results = {}
    ideals: dict[str, dict[str, float]] = {}
    for workload in [w for w in WORKLOADS[p.variant] if not only or w in only]:
        trace, _ = make_trace(workload, p)
        ideals[workload] = ideal(trace, p)
        results[workload] = {}
        restarts[workload] = {}
        middle = trace[p.warmup_requests + (len(trace) - p.warmup_requests) // 2].arrival_s
        for name, strategy in fleet_strategies(p).items():
            always = name == FLEET_BASELINE or name in FLEET_GOAL_STRATEGIES
            if strategies and not always and not any(part in name for part in strategies):
                continue
            per: dict[str, dict[str, float]] = {}
            for routers in (1, n_routers):
                r = per[str(routers)] = simulate(trace, strategy.factory, p, fleet=strategy.fleet(routers))
                print(
                    f"{workload:28s} {name:40s} routers {routers} hit {r['hit_rate']:.3f} "
                    f"imbalance {r['imbalance_served']:.2f} ttft mean {r['ttft_mean_s'] * 1000:.1f} ms "
                    f"p99 {r['ttft_p99_s'] * 1000:.0f} ms",
                    flush=True,
                )
            results[workload][name] = per
            if strategy.restart and n_routers > 1:
                r = restarts[workload][name] = simulate(
                    trace,
                    strategy.factory,
                    p,
                    fleet=strategy.fleet(n_routers),
                    restart=Restart(middle, RESTART_WINDOWS_S),
                )
                print(f"{workload:28s} {name:40s} restart " + restart_line(r), flush=True)
            if strategy.replayed is not None and n_routers > 1:
                for label, replay in REPLAYS.items():
                    row = f"{name}{REPLAY_ROW}{label}"
                    r = restarts[workload][row] = simulate(
                        trace,
                        strategy.factory,
                        p,
                        fleet=strategy.fleet(n_routers),
                        restart=Restart(
                            middle,
                            RESTART_WINDOWS_S,
                            replayed_restart(strategy.replayed, replay),
                            RESTART_SPANS_S,
                            engines_report_hits=replay.report_hits,
                        ),
                    )
                    print(f"{workload:28s} {row} " + view_line(r) + "; " + restart_line(r), flush=True)
        check_bound(
            workload, ideals[workload], {f"{s} x{n}": f for s, x in results[workload].items() for n, f in x.items()}
        )
    return FleetRun(p, n_routers, results, restarts, ideals)


def replayed_restart(
    build: Callable[[list[Engine], list[int]], Router], replay: Replay
) -> Callable[[list[Engine], float], tuple[Router, dict[str, float]]]:
    """The restarted process with KV events: its views start where ``replay`` lets them, at the restart."""

    def restart(engines: list[Engine], now: float) -> tuple[Router, dict[str, float]]:
        published = [e.published(now) for e in engines]
        first = [replay.first_batch(n) for n in published]
        held = sum(1 for e, f in zip(engines, first, strict=True) for b in e.cache.values() if b >= f)
        usable = sum(e.chained_from(f) for e, f in zip(engines, first, strict=True))
        cached = max(1, sum(len(e.cache) for e in engines))
        return build(engines, first), {
            "restart_at_s": now,
            "restart_published_batches_mean": statistics.mean(published),
            "restart_views_complete": sum(1 for f in first if f == 0) / len(first),
            "restart_view_share": held / cached,  # cached blocks last stored within the replayed batches
            "restart_view_usable_share": usable / cached,  # of which the whole chain is too (``chained_from``)
            # what the views replayed, in seconds back from the restart (the batch rate is near constant)
            "restart_horizon_s": statistics.mean(
                now * (n - f) / n if n else 0.0 for n, f in zip(published, first, strict=True)
            ),
        }

    return restart


def view_line(r: dict[str, float]) -> str:
    return (
        f"views complete on {r['restart_views_complete']:.0%} of the engines; {r['restart_view_share']:.0%} of the "
        f"cached blocks stored within the replay, {r['restart_view_usable_share']:.0%} with their whole chain "
        f"(~{r['restart_horizon_s']:.0f} s replayed of {r['restart_at_s']:.0f} s)"
    )


def restart_line(r: dict[str, float]) -> str:
    parts = []
    for lo, hi in itertools.pairwise(RESTART_WINDOWS_S):
        tag = f"{lo:g}_{hi:g}s"
        if f"restarted_{tag}_hit_rate" in r:
            parts.append(
                f"{lo:g}-{hi:g} s: hit {r[f'restarted_{tag}_hit_rate']:.3f} vs {r[f'others_{tag}_hit_rate']:.3f}, "
                f"mean {r[f'restarted_{tag}_ttft_mean_s'] * 1000:.0f} vs {r[f'others_{tag}_ttft_mean_s'] * 1000:.0f} ms"
            )
    return "; ".join(parts)


def fleet_goals(run: FleetRun) -> list[tuple[str, str, str, bool]]:
    """(workload, strategy, check, met): each goal strategy with N routers against one router of today's
    kvfleet."""
    n = str(run.routers)
    out = []
    for workload, r in run.results.items():
        one = r[FLEET_BASELINE]["1"]
        for strategy in FLEET_GOAL_STRATEGIES:
            ours = r[strategy][n]
            hit = ours["hit_rate"] / one["hit_rate"] if one["hit_rate"] else 1.0  # nothing shared: 0 of 0
            checks = [
                (
                    f"hit rate {ours['hit_rate']:.3f} = {hit:.3f} of one router's {one['hit_rate']:.3f} (goal >= 0.97)",
                    hit >= 0.97,
                ),
                (f"imbalance {ours['imbalance_served']:.2f} (goal <= 1.25)", ours["imbalance_served"] <= 1.25),
            ]
            for key, label in (("ttft_mean_s", "TTFT mean"), ("ttft_p99_s", "TTFT p99")):
                ratio = ours[key] / one[key]
                checks.append(
                    (
                        f"{label} {ours[key] * 1000:.1f} ms = {ratio:.2f}x one router's {one[key] * 1000:.1f} ms "
                        "(goal <= 1.1x)",
                        ratio <= 1.1,
                    )
                )
            rs = run.restarts.get(workload, {}).get(strategy)
            if rs is not None and "restarted_10_20s_hit_rate" in rs:
                others = rs["others_10_20s_hit_rate"]
                hit = rs["restarted_10_20s_hit_rate"] / others if others else 1.0
                mean = rs["restarted_10_20s_ttft_mean_s"] / rs["others_10_20s_ttft_mean_s"]
                checks.append(
                    (
                        f"restarted router 10-20 s after: hit rate {hit:.3f} of the others' (goal >= 0.97), "
                        f"TTFT mean {mean:.2f}x theirs (goal <= 1.1x)",
                        hit >= 0.97 and mean <= 1.1,
                    )
                )
            out += [(workload, strategy, check, met) for check, met in checks]
    return out


def restart_goals(run: FleetRun) -> list[tuple[str, str, str, bool]]:
    """(workload, restart row, check, met): each KV-events restart row's restarted router against the other
    routers in the same window: hit rate >= ``RESTART_GOAL_HIT`` x theirs over the first 10 s and over
    10-20 s; TTFT mean over 10-20 s <= 1.1x theirs (the fleet goals' restart check)."""
    out = []
    for workload, rows in run.restarts.items():
        for row, r in rows.items():
            if REPLAY_ROW not in row:
                continue
            for lo, hi in (*RESTART_SPANS_S, (10.0, 20.0)):
                tag = f"{lo:g}_{hi:g}s"
                ours, others = r[f"restarted_{tag}_hit_rate"], r[f"others_{tag}_hit_rate"]
                ratio = ours / others if others else 1.0  # nothing shared: 0 of 0
                out.append(
                    (
                        workload,
                        row,
                        f"{lo:g}-{hi:g} s: hit rate {ours:.3f} = {ratio:.3f} of the others' {others:.3f} "
                        f"(goal >= {RESTART_GOAL_HIT})",
                        ratio >= RESTART_GOAL_HIT,
                    )
                )
            mean = r["restarted_10_20s_ttft_mean_s"] / r["others_10_20s_ttft_mean_s"]
            out.append((workload, row, f"10-20 s: TTFT mean {mean:.2f}x the others' (goal <= 1.1x)", mean <= 1.1))
    return out


def write_fleet(out: Path, run: FleetRun, elapsed_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    n = str(run.routers)
    checks = fleet_goals(run)
    replay_checks = restart_goals(run)
    doc = {
        "elapsed_s": elapsed_s,
        "params": asdict(run.params),
        "routers": run.routers,
        "shared_load_s": SHARED_LOAD_S,
        "goal_strategies": list(FLEET_GOAL_STRATEGIES),
        "baseline": FLEET_BASELINE,
        "results": run.results,
        "restart": run.restarts,
        "ideal": run.ideals,
        "goals": [{"workload": w, "strategy": st, "check": c, "met": ok} for w, st, c, ok in checks],
        "event_step_s": EVENT_STEP_S,
        "replays": {label: replay.buffer_steps for label, replay in REPLAYS.items()},
        "restart_goals": [{"workload": w, "row": row, "check": c, "met": ok} for w, row, c, ok in replay_checks],
    }
    lines = [
        describe(run.params),
        f"Routers: 1 and {run.routers}, each request to one at random; each router has its own index and its "
        f"own in-flight counts; `+ engine load`: it also reads every engine's own counts every {SHARED_LOAD_S:g} s "
        "(all routers at once), and adds its own sends and completions since; `staggered, own x routers`: each "
        "router reads at its own phase, and counts its own sends and completions since x the routers; "
        "`+ peer load (t)`: each router adds the other routers' own counts, which they report on every change "
        "and it receives t later (`kvfleet.router.peer_load`).",
        "",
        f"| workload | strategy | hit rate (1 -> {n} routers) | imbalance | TTFT mean (ms) | TTFT p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for workload, r in run.results.items():
        for name, per in r.items():
            a, b = per["1"], per[n]
            lines.append(
                f"| {workload} | {name} | {a['hit_rate']:.3f} -> {b['hit_rate']:.3f} | "
                f"{a['imbalance_served']:.2f} -> {b['imbalance_served']:.2f} | "
                f"{a['ttft_mean_s'] * 1000:.1f} -> {b['ttft_mean_s'] * 1000:.1f} | "
                f"{a['ttft_p99_s'] * 1000:.0f} -> {b['ttft_p99_s'] * 1000:.0f} |"
            )
        ideal_ = run.ideals[workload]
        lines.append(
            f"| {workload} | {IDEAL} | {ideal_['hit_rate']:.3f} | - | {ideal_['ttft_mean_s'] * 1000:.1f} | "
            f"{ideal_['ttft_p99_s'] * 1000:.0f} |"
        )
    lines += [
        "",
        f"Restart: router 0 of {n} restarts (empty index, no in-flight view) halfway through the measured "
        "requests; the requests it routes against the other routers' in the same windows after the restart.",
        "",
        "| workload | strategy | window after restart | hit rate: restarted / others | "
        "TTFT mean (ms): restarted / others | TTFT p99 (ms): restarted / others | requests |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, r in run.restarts.items():
        for name, f in r.items():
            for lo, hi in itertools.pairwise(RESTART_WINDOWS_S):
                tag = f"{lo:g}_{hi:g}s"
                if f"restarted_{tag}_hit_rate" not in f:
                    continue
                lines.append(
                    f"| {workload} | {name} | {lo:g}-{hi:g} s | {f[f'restarted_{tag}_hit_rate']:.3f} / "
                    f"{f[f'others_{tag}_hit_rate']:.3f} | {f[f'restarted_{tag}_ttft_mean_s'] * 1000:.1f} / "
                    f"{f[f'others_{tag}_ttft_mean_s'] * 1000:.1f} | {f[f'restarted_{tag}_ttft_p99_s'] * 1000:.0f} / "
                    f"{f[f'others_{tag}_ttft_p99_s'] * 1000:.0f} | {f[f'restarted_{tag}_requests']:.0f} / "
                    f"{f[f'others_{tag}_requests']:.0f} |"
                )
    lines += [
        "",
        f"Goals: {' and '.join(f'`{g}`' for g in FLEET_GOAL_STRATEGIES)} with {n} routers against one router of "
        f"`{FLEET_BASELINE}` (today's kvfleet).",
        "",
        "| workload | strategy | goal | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {w} | {st} | {c} | {'met' if ok else 'MISSED'} |" for w, st, c, ok in checks]
    lines.append("")
    if replay_checks:
        lines += [
            f"Restart with KV events: router 0 of {n} restarts as above; its views of the engines' caches start "
            "with what the engine's replay buffer still holds (vLLM's ROUTER socket, asked from batch 0) or, "
            "without replay, empty, and then take every new batch. A view is complete only if the buffer still "
            "holds batch 0; a partial one holds the cached blocks last stored within the buffer and is scored as "
            "the larger of it and the new learned index (`EngineCaches.matched`). Event batches are counted "
            f"conservatively: one per {EVENT_STEP_S * 1000:g} ms of the engine's life (vLLM publishes a batch "
            "per step with events, and decode steps store generated blocks), plus one per prefill that stores "
            "blocks and one per prefill that evicts. The restart rows are in the restart table above.",
            "",
            "| workload | strategy, restart | views at the restart |",
            "|---|---|---|",
        ]
        for workload, rows in run.restarts.items():
            lines += [f"| {workload} | {row} | {view_line(f)} |" for row, f in rows.items() if REPLAY_ROW in row]
        lines += [
            "",
            f"Restart goals: the restarted router's hit rate >= {RESTART_GOAL_HIT}x the other routers' in the "
            "same window, over its first 10 s and over 10-20 s (the issue's goal: as well as the others within "
            "10 s of traffic); TTFT mean over 10-20 s <= 1.1x.",
            "",
            "| workload | strategy, restart | goal | verdict |",
            "|---|---|---|---|",
        ]
        lines += [f"| {w} | {row} | {c} | {'met' if ok else 'MISSED'} |" for w, row, c, ok in replay_checks]
        lines.append("")
    (out / "router_fleet_sim.json").write_text(json.dumps(doc, indent=2))
    (out / "router_fleet_sim.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["both", "h100", "small"], default="both")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=0, help="per workload (default: the variant's)")
    parser.add_argument("--warmup", type=int, default=-1, help="unmeasured warm-up requests (default: the variant's)")
    parser.add_argument("--cache-blocks", type=int, default=0, help="per replica (default: the variant's)")
    parser.add_argument("--utilisation", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bound", type=float, default=1.25, help="kvfleet's loadImbalanceBound")
    parser.add_argument("--load-penalty-blocks", type=float, default=LOAD_PENALTY_BLOCKS)
    parser.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    parser.add_argument(
        "--join",
        choices=["h100", "both", "none"],
        default="h100",
        help="run the join scenario (one replica joins empty) for these variants",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        help="N > 1: compare 1 and N routers for every strategy, with a router restart (h100 variant unless "
        "--variant says otherwise); writes router_fleet_sim.{json,md}",
    )
    parser.add_argument(
        "--strategies",
        default="",
        help="with --routers: ';'-separated parts of the strategies' names to run besides the baseline and the "
        "goal strategies (default: all)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    started = time.monotonic()
    if args.routers > 1 and args.variant == "both":
        args.variant = "h100"
    variants = ["h100", "small"] if args.variant == "both" else [args.variant]
    runs: dict[str, VariantRun] = {}
    for variant in variants:
        engine = H100_ENGINE if variant == "h100" else SMALL_ENGINE
        if args.cache_blocks:
            engine = EngineModel(**{**asdict(engine), "cache_blocks": args.cache_blocks})
        requests, warmup = DEFAULT_REQUESTS[variant]
        requests = args.requests or requests
        warmup = args.warmup if args.warmup >= 0 else min(warmup, requests // 3)
        p = Params(
            variant=variant,
            replicas=args.replicas,
            requests=requests,
            warmup_requests=warmup,
            engine=engine,
            utilisation=args.utilisation,
            seed=args.seed,
            bound=args.bound,
            load_penalty_blocks=args.load_penalty_blocks,
        )
        only = [w for w in args.only.split(",") if w]
        if args.routers > 1:
            strategies = [x for x in args.strategies.split(";") if x]
            write_fleet(args.out, run_fleet(p, only, args.routers, strategies), time.monotonic() - started)
            return
        with_join = args.join == "both" or args.join == variant
        runs[variant] = run_variant(p, only, with_join)
    write(args.out, runs, time.monotonic() - started)


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def p50_goal(workload: str, r: dict[str, dict[str, float]], bound: dict[str, float]) -> tuple[str, str, str]:
    """TTFT p50 >= 2x better than round-robin's; "infeasible" when even the ideal is not 2x better."""
    rr = r["round-robin"]["ttft_p50_s"]
    ours = r["kvfleet"]["ttft_p50_s"]
    best = bound["ttft_p50_s"]
    granular = bound["granular_ttft_p50_s"]
    check = (
        f"TTFT p50 {rr / ours:.1f}x better than round-robin (goal >= 2; "
        f"best possible {rr / best if best > 0 else float('inf'):.1f}x: ideal p50 {best * 1000:.1f} ms, "
        f"token-granular {granular * 1000:.1f} ms; sticky hashing's {r['sticky-hash']['ttft_p50_s'] * 1000:.1f} ms)"
    )
    if rr / ours >= 2:
        return workload, check, "met"
    if 2 * granular > rr:  # even the more optimistic bound is over half of round-robin's
        why = (
            f"infeasible: ideal p50 {best * 1000:.1f} ms (token-granular {granular * 1000:.1f} ms) > "
            f"round-robin p50 / 2 = {rr / 2 * 1000:.1f} ms"
        )
        return workload, f"{check}; {why}", "infeasible"
    return workload, check, "missed"


def goals(results: Results, ideals: dict[str, dict[str, float]]) -> list[tuple[str, str, str]]:
    """(workload, check, verdict), the verdict "met", "missed" or, where no router could meet it, "infeasible"."""
    out = []
    for workload, r in results.items():
        ours = r["kvfleet"]
        if workload == "nothing shared":
            ratio = ours["ttft_p50_s"] / r["least-load"]["ttft_p50_s"]
            out.append((workload, f"TTFT p50 within 5% of least-load: {ratio:.3f}x", met(ratio <= 1.05)))
            continue
        hit = ours["hit_rate"] / r["sticky-hash"]["hit_rate"]
        out.append((workload, f"hit rate {hit:.2f} of sticky hashing's (goal >= 0.90)", met(hit >= 0.9)))
        out.append(
            (
                workload,
                f"imbalance {ours['imbalance_served']:.2f} (goal <= 1.25)",
                met(ours["imbalance_served"] <= 1.25),
            )
        )
        out.append(p50_goal(workload, r, ideals[workload]))
        mean_speedup = r["round-robin"]["ttft_mean_s"] / ours["ttft_mean_s"]
        out.append(
            (workload, f"(context) TTFT mean {mean_speedup:.1f}x better than round-robin", met(mean_speedup >= 2))
        )
        p99_speedup = r["round-robin"]["ttft_p99_s"] / ours["ttft_p99_s"]
        out.append((workload, f"(context) TTFT p99 {p99_speedup:.1f}x better than round-robin", met(p99_speedup >= 2)))
    return out


def describe(p: Params) -> str:
    m = p.engine
    if p.variant == "h100":
        engine = (
            f"Llama-3.1-8B on one H100 each: {m.cache_blocks} cached blocks of {BLOCK_CHARS} chars "
            f"({m.cache_blocks * BLOCK_TOKENS / 1000:.0f}k tokens of KV), prefill one request at a time at "
            f"{1 / m.prefill_s_per_token:,.0f} tokens/s, then {m.output_tokens} tokens x "
            f"{m.decode_s_per_token * 1000:.0f} ms of decode beside later prefills"
        )
    else:
        engine = (
            f"{m.slots} slots each, {m.cache_blocks} cached blocks of {BLOCK_CHARS} chars "
            f"({m.cache_blocks * BLOCK_TOKENS / 1000:.0f}k tokens), prefill {m.prefill_s_per_token * 1000:.1f} "
            f"ms/token, {m.output_tokens} tokens x {m.decode_s_per_token * 1000:.0f} ms decode holding the slot"
        )
    return (
        f"Variant `{p.variant}`: {p.replicas} replicas, {engine}; {p.requests} requests per workload "
        f"({p.warmup_requests} of them unmeasured warm-up) at {p.utilisation:.0%} of the fleet's no-cache "
        f"capacity (seed {p.seed}); kvfleet with loadImbalanceBound {p.bound:g}, "
        f"load_penalty_blocks {p.load_penalty_blocks:g}."
    )


IDEAL = "ideal (lower bound)"


def write(out: Path, runs: dict[str, VariantRun], elapsed_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, object] = {"elapsed_s": elapsed_s, "variants": {}}
    lines: list[str] = []
    for variant, run in runs.items():
        p, results, stats, joins = run.params, run.results, run.stats, run.joins
        checks = goals(results, run.ideals)
        fleet_cache_tokens = p.engine.cache_blocks * BLOCK_TOKENS * p.replicas
        doc["variants"][variant] = {  # type: ignore[index]
            "params": asdict(p),
            "trace": {w: asdict(s) for w, s in stats.items()},
            "results": results,
            "ideal": run.ideals,
            "join": joins,
            "goals": [{"workload": w, "check": c, "met": v == "met", "verdict": v} for w, c, v in checks],
        }
        lines += [
            f"### Variant `{variant}`",
            "",
            describe(p),
            "",
            "| workload | arrivals (req/s) | mean prompt (tokens) | reused prompt tokens: blocks in 2+ prompts "
            "(x one replica's cache, x the fleet's) |",
            "|---|---|---|---|",
        ]
        for w, s in stats.items():
            lines.append(
                f"| {w} | {s.rate_per_s:.1f} | {s.mean_prompt_tokens:.0f} | {s.reused_prompt_tokens / 1e6:.2f}M "
                f"({s.reused_prompt_tokens * p.replicas / fleet_cache_tokens:.1f}x, "
                f"{s.reused_prompt_tokens / fleet_cache_tokens:.2f}x) |"
            )
        lines += [
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
            b = run.ideals[workload]
            lines.append(
                f"| {workload} | {IDEAL} | {b['hit_rate']:.3f} | - | - | {b['ttft_p50_s'] * 1000:.1f} | "
                f"{b['ttft_p90_s'] * 1000:.1f} | {b['ttft_p99_s'] * 1000:.1f} | {b['ttft_mean_s'] * 1000:.1f} |"
            )
            lines.append(
                f"| {workload} | {IDEAL}, token-granular | - | - | - | {b['granular_ttft_p50_s'] * 1000:.1f} | - | "
                f"{b['granular_ttft_p99_s'] * 1000:.1f} | - |"
            )
        lines += [
            "",
            f"`{IDEAL}`: each measured request's TTFT if the fleet were one replica with an infinite prefix "
            "cache and no queue: the prefill of its tokens after its leading blocks that any earlier request "
            "brought. No strategy can beat it on this trace and engine model (the run asserts that every "
            f"strategy's p50, p99 and mean are at or above it). `token-granular`: {BLOCK_TOKENS} more tokens "
            "cached per request, the most an engine caching shared prefixes to the token rather than in whole "
            "blocks could save. A TTFT p50 goal is `infeasible` when even the token-granular p50 is more than "
            "half of round-robin's.",
            "",
            "| workload | goal | verdict |",
            "|---|---|---|",
        ]
        lines += [f"| {w} | {c} | {v if v == 'met' else v.upper()} |" for w, c, v in checks]
        lines.append("")
        if joins:
            lines += [
                f"Join: replica {p.replicas - 1} is absent (the others take its share) until halfway through "
                f"the measured requests, then joins with an empty cache and nothing in flight; measured over "
                f"the {JOIN_WINDOW_S:g} s after it joins.",
                "",
                "| workload | strategy | new replica's share of the first second's arrivals | of the window's | "
                f"its peak waiting | TTFT p50 (ms) | TTFT p99 (ms) | TTFT over {JOIN_SLO_S:g} s | requests |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for workload, r in joins.items():
                for name, m in r.items():
                    lines.append(
                        f"| {workload} | {name} | {m['joined_share_first_s']:.0%} | {m['joined_share_window']:.0%} | "
                        f"{m['joined_peak_waiting']:.0f} | {m['ttft_p50_s'] * 1000:.0f} | "
                        f"{m['ttft_p99_s'] * 1000:.0f} | {m['ttft_misses']:.0f} | {m['window_requests']:.0f} |"
                    )
            lines.append("")
    (out / "router_sim.json").write_text(json.dumps(doc, indent=2))
    (out / "router_sim.md").write_text("\n".join(lines))
    plot(out / "router_sim.png", runs)
    print("\n".join(lines))


def plot(path: Path, runs: dict[str, VariantRun]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("hit_rate", "prefix hit rate"),
        ("imbalance_served", "load imbalance (max/mean served)"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("ttft_p99_s", "TTFT p99 (s)"),
    ]
    fig, axes = plt.subplots(len(runs), len(metrics), figsize=(20, 4.5 * len(runs)), squeeze=False)
    for row, (variant, run) in zip(axes, runs.items(), strict=True):
        results = run.results
        workloads = list(results)
        strategies = list(next(iter(results.values())))
        width = 0.8 / len(strategies)
        for ax, (key, title) in zip(row, metrics, strict=True):
            for j, s in enumerate(strategies):
                ax.bar(
                    [i + j * width for i in range(len(workloads))],
                    [results[w][s][key] for w in workloads],
                    width,
                    label=s,
                )
            if key in ("hit_rate", "ttft_p50_s", "ttft_p99_s"):  # the lower bound (for hit rate, the ceiling)
                ax.hlines(
                    [run.ideals[w][key] for w in workloads],
                    [i - width / 2 for i in range(len(workloads))],
                    [i + 0.8 - width / 2 for i in range(len(workloads))],
                    colors="black",
                    linestyles="dashed",
                    label=IDEAL,
                )
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
            ax.set_xticklabels([w.replace(" ", "\n", 1) for w in workloads], fontsize=8)
            ax.set_title(f"{variant}: {title}")
            if key.startswith("ttft"):
                ax.set_yscale("log")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
