"""Replica picking as small parts: filters narrow the candidates, scorers rate them, a picker chooses.

Contracts:
- A ``Filter`` returns a subset of its input. A ``required`` filter that leaves none means there is no
  candidate at all; any other filter that leaves none is skipped (the fallback is the next best).
- A ``Scorer`` is read-only and returns a score per candidate, in the candidates' order (higher is
  better). The strategy adds scores times their weights, so scorers weighed against each other share
  one unit: the prefix strategy counts prompt blocks (blocks of prefill a replica saves, against
  in-flight requests priced in blocks of prefill each).
- A ``Picker`` chooses one candidate given the weighted total scores.
Nothing here does I/O or reads a clock: the fleet passes in each replica's counts and state, and
calls ``Strategy.learn`` once the request is sent, so the prefix index learns only after the pick.

Two load signals, each used where it measures what matters:
- ``waiting``: requests sent and not yet answered with a first byte, i.e. queued or prefilling. A new
  request's TTFT is the prefill ahead of it; with continuous batching most in-flight requests are
  decoding and say little about that queue, and a replica that just joined with nothing in flight
  is not therefore the shortest queue for long. Least-load ranks by it first, and so does the queue
  scorer for a prompt no replica holds any of (its placement has no future cost, only its wait).
- ``inflight``: everything sent and not finished (decoding too). The load bound caps this (the
  spec's ``loadImbalanceBound`` x the mean in flight); the queue scorer prices it for a prompt some
  replica holds a prefix of, which keeps headroom under that bound for the placements worth keeping
  (routing_sim: pricing waiting there instead lost hit rate in multi-turn chat); among equal scores
  the fewest in flight wins (a smaller decode batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvfleet.router.engine_caches import EngineCaches
from kvfleet.router.placement import PlacementScorer
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prefix_scorer import PrefixScorer
from kvfleet.spec import RoutingSpec

if TYPE_CHECKING:
    from kvfleet.router.prompt_tokens import PromptTokenizer


# Named tuples, not dataclasses: three are built per routed request, and a tuple is ~4x cheaper to make.
class Candidate(NamedTuple):
    """One replica as the picker sees it."""

    replica_id: str
    inflight: int  # sent, not finished
    draining: bool = False
    ejected: bool = False
    waiting: int = 0  # sent, no response byte yet: queued or prefilling


class PickRequest(NamedTuple):
    """What is being routed: the prompt's block hashes, replicas this request already failed on, its home key."""

    hashes: Sequence[int] = ()
    exclude: frozenset[str] = frozenset()
    home_key: int | None = None  # the prompt's placement key, alike in every router (placement.home_key)
    home_block: int = 0  # the block the key ends with: where the prompt diverges from the others seen
    # The prompt's token blocks as engines hash them in their KV-cache events (engine_caches.py), with
    # their block size; None: not tokenized (no events, or no tokenizer for the model).
    engine_blocks: Sequence[int] | None = None
    engine_block_size: int = 0


class Pick(NamedTuple):
    """The chosen replica and why (``reason`` is rendered only when asked for: it is for logs)."""

    replica_id: str
    matched_blocks: int
    total_blocks: int
    strategy: str = ""
    inflight: int = 0
    score: float = 0.0
    dropped: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (filter, replicas it dropped; empty: it left none)
    waiting: int = 0

    @property
    def match_ratio(self) -> float:
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def reason(self) -> str:
        text = (
            f"{self.strategy}: {self.replica_id} matched {self.matched_blocks}/{self.total_blocks} blocks, "
            f"in-flight {self.inflight}, waiting {self.waiting}, score {self.score:.3f}"
        )
        notes = [
            f"{name}: dropped {','.join(gone)}" if gone else f"{name}: kept all (filter left none)"
            for name, gone in self.dropped
        ]
        return "; ".join([text, *notes])


class Filter(Protocol):
    name: str
    required: bool

    def filter(self, candidates: Sequence[Candidate], request: PickRequest) -> list[Candidate]: ...


class Scorer(Protocol):
    name: str

    def score(self, candidates: Sequence[Candidate], request: PickRequest) -> list[float]: ...


class Picker(Protocol):
    def pick(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> Candidate: ...


def _replica_id(candidate: Candidate) -> str:  # a sort key: ties go in a stable order
    return candidate.replica_id


class RoutableFilter:
    """Drops draining replicas; prefers replicas this request has not failed on, then ones not ejected.

    Preferences fall back rather than empty the set: a request that failed on every replica may try
    one again (a stale keep-alive connection fails once and then works), and when every replica is
    ejected the ejected ones are kept (panic mode, as Envoy does). Only draining is absolute.
    """

    name = "routable"
    required = True

    def filter(self, candidates: Sequence[Candidate], request: PickRequest) -> list[Candidate]:
        live = [c for c in candidates if not c.draining]
        fresh = ([c for c in live if c.replica_id not in request.exclude] or live) if request.exclude else live
        for c in fresh:
            if c.ejected:
                return [c for c in fresh if not c.ejected] or fresh
        return fresh


@dataclass
class BoundedLoadFilter:
    """Keeps replicas whose in-flight count, with this request added, stays within ``bound`` x the mean.

    The cap is ``ceil(bound * (total_inflight + 1) / n) + slack`` over the routable replicas: the
    least-loaded replica always fits (its load is at most the mean), so the filter never empties a
    non-empty set. ``slack`` (requests) keeps the cap from dropping a prompt's home over the noise of
    small counts: each of several routers sees only its own share of the in-flight requests, a few per
    replica, where one request more is already 1.25x (bench/routing_sim.py --routers).
    """

    bound: float
    slack: int = 0
    name: str = "bounded-load"
    required: bool = False

    def cap(self, candidates: Sequence[Candidate]) -> int:
        total = sum([c.inflight for c in candidates]) + 1
        return max(1, math.ceil(self.bound * total / max(1, len(candidates)) - 1e-9)) + self.slack

    def filter(self, candidates: Sequence[Candidate], request: PickRequest) -> list[Candidate]:
        cap = self.cap(candidates)
        return [c for c in candidates if c.inflight + 1 <= cap]


@dataclass
class QueueScorer:
    """Minus the load a candidate has beyond the least-loaded candidate, in requests.

    Weighted by the blocks of prefill one request is worth, it prices load in the prefix scorer's
    unit. Which count is the load depends on whether the prompt has a home:
    - some replica holds the prompt's first block (so a prefix of it), by the index: in-flight. A
      replica holding ``m`` more blocks wins while it has fewer than ``m / weight`` more requests in
      flight, so short prompts move off busy replicas first, keeping headroom under the in-flight
      load bound for the long ones that are costly to move (and costly again next turn).
    - none does (or no index): ``waiting``, the prefill queue. Nothing is cached anywhere, so the
      pick has no future cost and the only one is the wait before this request's prefill, which
      queued prefills set and decoding requests hardly touch.
    """

    index: PrefixIndex | None = None
    caches: EngineCaches | None = None
    name: str = "queue"

    def score(self, candidates: Sequence[Candidate], request: PickRequest) -> list[float]:
        held = self._held_somewhere(request)
        loads = [c.inflight for c in candidates] if held else [c.waiting for c in candidates]
        least = min(loads, default=0)
        return [float(least - load) for load in loads]

    def _held_somewhere(self, request: PickRequest) -> bool:
        if self.index is not None and request.hashes and self.index.held_anywhere(request.hashes[0]):
            return True
        tokens = request.engine_blocks
        return bool(self.caches is not None and tokens and self.caches.held_anywhere(tokens[0]))


class LoadScorer:
    """1 for an empty prefill queue, falling towards 0 as ``waiting`` nears the longest queue's.

    Ties (equal queues, e.g. all empty) go to the fewest in flight in ``MaxScorePicker``, so
    least-load is "shortest prefill queue, then smallest decode batch".
    """

    name = "load"

    def score(self, candidates: Sequence[Candidate], request: PickRequest) -> list[float]:
        waiting = [c.waiting for c in candidates]
        longest = max(waiting, default=0)
        return [1.0 - w / (longest + 1) for w in waiting]


@dataclass
class MaxScorePicker:
    """Highest total score; ties go to the fewest in-flight, then rotate so equals share the work."""

    _turn: int = 0

    def pick(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> Candidate:
        self._turn += 1
        if len(candidates) == 1:
            return candidates[0]
        best = max(scores) - 1e-12
        top = [c for c, score in zip(candidates, scores, strict=True) if score >= best]
        if len(top) == 1:
            return top[0]
        least = min([c.inflight for c in top])
        tied = [c for c in top if c.inflight == least]
        if len(tied) == 1:
            return tied[0]
        tied.sort(key=_replica_id)
        return tied[self._turn % len(tied)]


@dataclass
class RoundRobinPicker:
    """Each candidate in turn, ignoring scores."""

    _turn: int = 0

    def pick(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> Candidate:
        ordered = sorted(candidates, key=_replica_id)
        chosen = ordered[self._turn % len(ordered)]
        self._turn += 1
        return chosen


@dataclass
class Strategy:
    """Filters, weighted scorers and a picker, run in that order; ``prefix`` learns after each pick.

    Every strategy keeps its deployment's prefix index learning through ``prefix`` (and reports each
    pick's match with it), so a deployment that switches to the prefix strategy starts warm; only the
    prefix strategy also scores with it.
    """

    name: str
    prefix: PrefixScorer
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker

    def pick(self, candidates: Sequence[Candidate], request: PickRequest) -> Pick | None:
        """The replica to send ``request`` to, or None when there is no candidate at all."""
        if not candidates:
            return None
        remaining = candidates
        count = len(remaining)
        dropped: list[tuple[str, tuple[str, ...]]] = []
        for f in self.filters:
            kept = f.filter(remaining, request)
            kept_count = len(kept)
            if not kept_count:
                if f.required:
                    return None
                dropped.append((f.name, ()))
                continue
            if kept_count < count:
                left = {c.replica_id for c in kept}
                dropped.append((f.name, tuple(sorted(c.replica_id for c in remaining if c.replica_id not in left))))
            remaining, count = kept, kept_count
            if count == 1:
                # The later filters never empty a set (they are skipped when they would), so one candidate
                # stays the only one, and scores cannot change a choice of one.
                return self._pick(remaining[0], request, 0.0, dropped)
        # Lists aligned with ``remaining``, not dicts by replica id: this runs for every routed request.
        totals: list[float] | None = None
        matched: list[float] | None = None  # the prefix scorer's index counts, when that is what it scored
        for scorer, weight in self.scorers:
            scores = scorer.score(remaining, request)
            if scorer is self.prefix and not self.prefix.by_engine(request):
                matched = scores
            if totals is None:
                totals = [weight * s for s in scores]
            else:
                totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
        if totals is None:
            totals = [0.0] * count
        chosen = self.picker.pick(remaining, totals)
        at = remaining.index(chosen)
        return self._pick(chosen, request, totals[at], dropped, int(matched[at]) if matched is not None else None)

    def learn(self, pick: Pick, request: PickRequest) -> None:
        """Called once the request is sent to ``pick``'s replica: the prefix index learns it (never while scoring)."""
        self.prefix.learn(pick.replica_id, request.hashes)

    def _pick(
        self,
        chosen: Candidate,
        request: PickRequest,
        score: float,
        dropped: list[tuple[str, tuple[str, ...]]],
        matched: int | None = None,
    ) -> Pick:
        if matched is None:  # not scored by the index (another strategy, the engines' caches, a single candidate)
            matched = self.prefix.matched(chosen.replica_id, request.hashes)
        return Pick(
            chosen.replica_id,
            matched,
            len(request.hashes),
            self.name,
            chosen.inflight,
            score,
            tuple(dropped),
            chosen.waiting,
        )


def build_strategy(
    routing: RoutingSpec,
    index: PrefixIndex,
    *,
    load_penalty_blocks: float,
    placement: bool = False,
    load_bound_slack: int = 0,
    caches: EngineCaches | None = None,
    model: str = "",
    max_prompt_blocks: int = 2048,
    tokenizer: PromptTokenizer | None = None,
) -> Strategy:
    """The strategy a deployment's ``spec.routing`` asks for.

    ``load_penalty_blocks``: blocks of prefill one extra in-flight request is worth (prefix strategy).
    ``placement``: the prefix strategy also scores each request's rendezvous home (``placement``), so
    that several routers agree; it scores nothing for requests without a ``home_key``.
    ``load_bound_slack``: requests allowed over the load bound's cap (``BoundedLoadFilter.slack``).
    ``caches``: the model's replicas' KV-cache event views, read by the prefix strategy where live.
    ``model``, ``max_prompt_blocks``: the served name that seeds the prompt's block hashes, and how many
    blocks are hashed (``PrefixScorer.hashes``; the block size is ``routing.prefix_block_chars``).
    ``tokenizer``: the model's, when its prompts are also cut into the engines' token blocks (KV events).
    """
    routable = RoutableFilter()
    prefix = PrefixScorer(
        index,
        caches,
        model=model,
        block_chars=routing.prefix_block_chars,
        max_blocks=max_prompt_blocks,
        tokenizer=tokenizer,
    )
    if routing.strategy == "round-robin":
        return Strategy("round-robin", prefix, [routable], [], RoundRobinPicker())
    if routing.strategy == "least-load":
        return Strategy("least-load", prefix, [routable], [(LoadScorer(), 1.0)], MaxScorePicker())
    scorers: list[tuple[Scorer, float]] = [
        (prefix, 1.0),
        (QueueScorer(index, caches), load_penalty_blocks),
    ]
    if placement:
        scorers.append((PlacementScorer(index), 1.0))
    return Strategy(
        "prefix",
        prefix,
        [routable, BoundedLoadFilter(routing.load_imbalance_bound, load_bound_slack)],
        scorers,
        MaxScorePicker(),
    )
