"""The picker's parts and strategies, with hand-checkable numbers (block size 4)."""

from __future__ import annotations

import math

import pytest

from kvfleet.router.outlier import OutlierDetector
from kvfleet.router.picking import (
    BoundedLoadFilter,
    Candidate,
    LoadScorer,
    PickRequest,
    PrefixScorer,
    QueueScorer,
    RoutableFilter,
    build_strategy,
)
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import block_hashes
from kvfleet.spec import RoutingSpec


def hashes(text: str) -> list[int]:
    return block_hashes(text, model="m", block_chars=4, max_blocks=100)


def cands(**inflight: int) -> list[Candidate]:
    """Every request in flight still waiting for its first byte (waiting = in flight): the picker as it
    was before it had the waiting count, so these tests keep their numbers."""
    return [Candidate(name, n, waiting=n) for name, n in inflight.items()]


def queues(**counts: tuple[int, int]) -> list[Candidate]:
    """Candidates from (in flight, waiting) pairs."""
    return [Candidate(name, inflight, waiting=waiting) for name, (inflight, waiting) in counts.items()]


def test_bounded_load_cap_by_hand() -> None:
    f = BoundedLoadFilter(bound=1.25)
    # 4 replicas, 8 in flight; with this request 9: mean 2.25, cap ceil(1.25 * 2.25) = ceil(2.8125) = 3.
    candidates = cands(a=5, b=1, c=1, d=1)
    assert f.cap(candidates) == 3
    assert [c.replica_id for c in f.filter(candidates, PickRequest())] == ["b", "c", "d"]
    # Idle fleet: cap 1, every replica fits.
    assert f.cap(cands(a=0, b=0)) == 1
    assert len(f.filter(cands(a=0, b=0), PickRequest())) == 2


@pytest.mark.parametrize("loads", [(0,), (3, 0), (9, 9, 0, 1), (5, 5, 5, 5), (100, 0, 0, 0, 0, 0, 0, 0)])
def test_bounded_load_never_empties_the_set(loads: tuple[int, ...]) -> None:
    candidates = [Candidate(f"r{i}", n) for i, n in enumerate(loads)]
    kept = BoundedLoadFilter(bound=1.0).filter(candidates, PickRequest())
    assert min(c.inflight for c in candidates) in {c.inflight for c in kept}


def test_routable_filter_preferences() -> None:
    f = RoutableFilter()
    all_ = [Candidate("a", 0, draining=True), Candidate("b", 0, ejected=True), Candidate("c", 0)]
    assert [c.replica_id for c in f.filter(all_, PickRequest())] == ["c"]
    # c already failed this request: b (ejected) is not preferred over it, c is retried only if nothing else
    assert [c.replica_id for c in f.filter(all_, PickRequest(exclude=frozenset({"c"})))] == ["b"]
    # Everything ejected: panic mode keeps them; draining is never routable.
    ejected = [Candidate("a", 0, draining=True), Candidate("b", 0, ejected=True)]
    assert [c.replica_id for c in f.filter(ejected, PickRequest())] == ["b"]
    assert f.filter([Candidate("a", 0, draining=True)], PickRequest()) == []


def test_scorers_by_hand() -> None:
    index = PrefixIndex(100)
    index.record("a", hashes("SSSSuuuu"))
    request = PickRequest(hashes("SSSSvvvvwwww"))
    # a holds the first of the request's 3 blocks (matched blocks, not the fraction)
    assert PrefixScorer(index).score(cands(a=0, b=0), request) == [1.0, 0.0]
    assert LoadScorer().score(cands(a=3, b=0), request) == [0.25, 1.0]
    # in-flight beyond the least-loaded candidate, negated
    assert QueueScorer().score(cands(a=3, b=1, c=2), request) == [-2.0, 0.0, -1.0]


def test_prefix_cost_trades_blocks_saved_against_requests_ahead() -> None:
    """Score = matched blocks - load_penalty_blocks x (in-flight - least in-flight); bound 3 keeps everyone in."""
    index = PrefixIndex(100)
    strategy = build_strategy(RoutingSpec(load_imbalance_bound=3.0), index, load_penalty_blocks=2)
    short = hashes("SSSSaaaabbbbccccddddeeeeffff")  # 7 blocks; a holds the first 6, b only the first
    index.record("a", short[:6])
    index.record("b", short[:1])
    # a: 6 - 2 x (2 - 1) = 4; b: 1 - 0 = 1; c: 0 - 0 = 0 -> a (cap ceil(3 x 6 / 4) = 5 keeps everyone)
    pick = strategy.pick(cands(a=2, b=1, c=1, d=1), PickRequest(short))
    assert pick is not None and pick.replica_id == "a" and pick.matched_blocks == 6
    # a with 4 in flight: 6 - 2 x 3 = 0 < b's 1 -> the short prompt moves to b (cap ceil(3 x 8 / 4) = 6)
    pick = strategy.pick(cands(a=4, b=1, c=1, d=1), PickRequest(short))
    assert pick is not None and pick.replica_id == "b" and pick.matched_blocks == 1
    # a longer history on a is worth the wait: a holds 10 of 12 blocks: 10 - 2 x 3 = 4 > b's 1 -> a
    long = hashes("SSSSaaaabbbbccccddddeeeeffffgggghhhhiiiijjjjkkkk")
    index.record("a", long[:10])
    pick = strategy.pick(cands(a=4, b=1, c=1, d=1), PickRequest(long))
    assert pick is not None and pick.replica_id == "a" and pick.matched_blocks == 10


def test_over_the_bound_the_longest_match_under_the_cap_wins() -> None:
    index = PrefixIndex(100)
    strategy = build_strategy(RoutingSpec(load_imbalance_bound=1.25), index, load_penalty_blocks=1)
    prompt = hashes("SSSSaaaabbbbccccdddd")  # 5 blocks
    index.record("a", prompt)  # a holds all 5, b 3, c 1, d none
    index.record("b", prompt[:3])
    index.record("c", prompt[:1])
    # cap = ceil(1.25 x (5 + 1) / 4) = ceil(1.875) = 2: a (3 in flight) is out.
    # b: 3 - 1 x (1 - 0) = 2; c: 1 - 0 = 1; d: 0 - 0 = 0 -> b, the longest match left, although busier.
    pick = strategy.pick(cands(a=3, b=1, c=0, d=1), PickRequest(prompt))
    assert pick is not None and pick.replica_id == "b" and pick.matched_blocks == 3
    assert "bounded-load: dropped a" in pick.reason


def test_prefix_strategy_follows_the_cache_then_the_bound() -> None:
    index = PrefixIndex(100)
    strategy = build_strategy(RoutingSpec(), index, load_penalty_blocks=4)
    prompt = hashes("system prompt shared by all" + " question")
    index.record("b", prompt)
    pick = strategy.pick(cands(a=0, b=0, c=0, d=0), PickRequest(prompt))
    assert pick is not None and pick.replica_id == "b" and pick.match_ratio == 1.0
    # b is busy beyond the bound: cap = ceil(1.25 * 7 / 4) = 3, b at 3 would become 4.
    pick = strategy.pick(cands(a=1, b=3, c=1, d=1), PickRequest(prompt))
    assert pick is not None and pick.replica_id != "b"
    assert "bounded-load: dropped b" in pick.reason
    assert strategy.pick([], PickRequest(prompt)) is None


def test_prefix_strategy_without_sharing_is_least_load() -> None:
    strategy = build_strategy(RoutingSpec(), PrefixIndex(100), load_penalty_blocks=4)
    pick = strategy.pick(cands(a=2, b=0, c=1), PickRequest(hashes("nothing shared here")))
    assert pick is not None and pick.replica_id == "b"


def test_least_load_and_round_robin() -> None:
    least = build_strategy(RoutingSpec(strategy="least-load"), PrefixIndex(100), load_penalty_blocks=4)
    assert least.pick(cands(a=2, b=1, c=3), PickRequest()).replica_id == "b"  # type: ignore[union-attr]
    rr = build_strategy(RoutingSpec(strategy="round-robin"), PrefixIndex(100), load_penalty_blocks=4)
    picks = [rr.pick(cands(a=9, b=0, c=0), PickRequest()).replica_id for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_equal_scores_share_the_work() -> None:
    strategy = build_strategy(RoutingSpec(), PrefixIndex(100), load_penalty_blocks=4)
    picks = {strategy.pick(cands(a=0, b=0, c=0), PickRequest()).replica_id for _ in range(3)}  # type: ignore[union-attr]
    assert picks == {"a", "b", "c"}


def test_skewed_workload_respects_the_bound() -> None:
    """One hot prompt, requests arriving faster than they finish: no pick exceeds the bound's cap."""
    index = PrefixIndex(1000)
    strategy = build_strategy(RoutingSpec(load_imbalance_bound=1.25), index, load_penalty_blocks=4)
    load = {f"r{i}": 0 for i in range(4)}
    hot = hashes("the one hot system prompt " * 4)
    for step in range(400):
        candidates = [Candidate(r, n) for r, n in load.items()]
        pick = strategy.pick(candidates, PickRequest(hot))
        assert pick is not None
        cap = math.ceil(1.25 * (sum(load.values()) + 1) / len(load))
        assert load[pick.replica_id] + 1 <= cap
        load[pick.replica_id] += 1
        index.record(pick.replica_id, hot)
        if step % 3 == 2:  # one in three finishes, so load keeps growing
            busiest = max(load, key=lambda r: load[r])
            load[busiest] -= 1
    assert max(load.values()) <= math.ceil(1.25 * sum(load.values()) / len(load))


def test_outlier_ejection_backs_off_and_recovers() -> None:
    det = OutlierDetector(failures_to_eject=2, base_ejection_s=1.0, max_ejection_s=3.0)
    assert det.record_failure("r", now_s=0.0) is None
    assert det.none_ejected(0.0)
    assert det.record_failure("r", now_s=0.0) == 1.0
    assert det.is_ejected("r", 0.5) and not det.is_ejected("r", 1.0)
    assert not det.none_ejected(0.5) and det.none_ejected(1.0)  # the fleet's per-request shortcut
    det.record_failure("r", now_s=1.0)
    assert det.record_failure("r", now_s=1.0) == 2.0  # doubled
    det.record_failure("r", now_s=3.0)
    assert det.record_failure("r", now_s=3.0) == 3.0  # capped
    det.record_success("r")
    det.record_failure("r", now_s=10.0)
    assert det.record_failure("r", now_s=10.0) == 1.0  # a success resets the back-off
    det.forget("r")
    assert det.tracked() == []


def test_queue_scorer_prices_waiting_when_no_replica_holds_the_prompt() -> None:
    # a: 10 in flight, all decoding (none waiting); b: 2 in flight, both waiting; c: 4 in flight, 1 waiting.
    candidates = queues(a=(10, 0), b=(2, 2), c=(4, 1))
    index = PrefixIndex(100)
    request = PickRequest(hashes("SSSSqqqq"))
    # Nothing cached anywhere: the prefill queue beyond the shortest (a's 0).
    assert QueueScorer(index).score(candidates, request) == [0.0, -2.0, -1.0]
    assert QueueScorer().score(candidates, request) == [0.0, -2.0, -1.0]  # no index: the same
    # c holds the first block: in flight beyond the least (b's 2), to keep headroom under the bound.
    index.record("c", hashes("SSSSzzzz"))
    assert QueueScorer(index).score(candidates, request) == [-8.0, 0.0, -2.0]
    # longest queue 2: 1 - waiting / 3
    assert LoadScorer().score(candidates, request) == [1.0, pytest.approx(1 / 3), pytest.approx(2 / 3)]


def test_least_load_is_shortest_queue_then_fewest_inflight() -> None:
    least = build_strategy(RoutingSpec(strategy="least-load"), PrefixIndex(100), load_penalty_blocks=4)
    # a and c have empty queues; c has the smaller decode batch.
    pick = least.pick(queues(a=(10, 0), b=(2, 1), c=(4, 0)), PickRequest())
    assert pick is not None and pick.replica_id == "c"
    assert "in-flight 4, waiting 0" in pick.reason
    # b has the fewest in flight but one request ahead in its queue: a, with 10 decoding, starts sooner.
    pick = least.pick(queues(a=(10, 0), b=(2, 1)), PickRequest())
    assert pick is not None and pick.replica_id == "a"


def test_prefix_strategy_prices_waiting_only_for_a_prompt_with_no_home() -> None:
    index = PrefixIndex(100)
    strategy = build_strategy(RoutingSpec(load_imbalance_bound=3.0), index, load_penalty_blocks=2)
    # cap = ceil(3 x (6 + 1 + 2 + 1) / 3) = 10: everyone fits.
    counts = queues(a=(6, 0), b=(1, 2), c=(2, 1))
    # Nothing cached: -2 x waiting beyond a's 0: a 0, b -4, c -2 -> a (6 decoding, an empty queue).
    pick = strategy.pick(counts, PickRequest(hashes("SSSSaaaa")))
    assert pick is not None and pick.replica_id == "a" and pick.matched_blocks == 0
    # a holds 2 blocks of this prompt: in flight is priced: a 2 - 2 x (6 - 1) = -8, b 0, c -2 -> b.
    index.record("a", hashes("TTTTbbbb"))
    pick = strategy.pick(counts, PickRequest(hashes("TTTTbbbbcccc")))
    assert pick is not None and pick.replica_id == "b"
    # a holds all 12 blocks of a longer prompt: 12 - 10 = 2 > b's 0 -> a.
    long = hashes("UUUU" + "x" * 44)
    index.record("a", long)
    pick = strategy.pick(counts, PickRequest(long))
    assert pick is not None and pick.replica_id == "a" and pick.matched_blocks == 12


def test_the_load_bound_stays_on_inflight() -> None:
    strategy = build_strategy(RoutingSpec(load_imbalance_bound=1.25), PrefixIndex(100), load_penalty_blocks=4)
    # Nothing cached, so the queue decides and a's is the shortest; but a has 7 in flight:
    # cap = ceil(1.25 x (7 + 1 + 1 + 1 + 1) / 4) = ceil(3.4375) = 4, and 7 + 1 > 4.
    pick = strategy.pick(queues(a=(7, 0), b=(1, 1), c=(1, 1), d=(1, 1)), PickRequest(hashes("SSSSaaaa")))
    assert pick is not None and pick.replica_id != "a"
    assert "bounded-load: dropped a" in pick.reason
    # Without the bound (3.0: cap ceil(3 x 11 / 4) = 9) the shortest queue wins.
    loose = build_strategy(RoutingSpec(load_imbalance_bound=3.0), PrefixIndex(100), load_penalty_blocks=4)
    pick = loose.pick(queues(a=(7, 0), b=(1, 1), c=(1, 1), d=(1, 1)), PickRequest(hashes("SSSSaaaa")))
    assert pick is not None and pick.replica_id == "a"


@pytest.mark.parametrize(
    ("signal", "to_new", "joined_at"),
    [
        # The picker fed in-flight as its queue (as before the waiting count): the empty replica takes all 12.
        ("inflight", 12, list(range(1, 13))),
        # Waiting first: h takes arrivals until its queue is level with the others' 2 (arrivals 1-2), wins
        # the tie on in-flight (3), then the seven others take one each (4-10) and h the next tie (11).
        ("waiting", 4, [1, 2, 3, 11]),
    ],
)
@pytest.mark.parametrize("strategy_name", ["least-load", "prefix"])
def test_a_replica_that_joins_empty_gets_its_queue_level_not_every_arrival(
    signal: str, to_new: int, joined_at: list[int], strategy_name: str
) -> None:
    """a-g run 40 requests each, 2 of them waiting; h joins with none. 12 arrivals, none finishing.

    Eight replicas, so the load bound does not bind: cap = ceil(1.25 x (280 + 1) / 8) = 44 > 40. (With
    four, 3 x 40 / 4 = 30 is the mean and the others' 40 is over 1.25 x 30: the bound, on in-flight by
    the spec, itself sends the joiner everything until the others fit under it again.)
    """
    strategy = build_strategy(RoutingSpec(strategy=strategy_name), PrefixIndex(100), load_penalty_blocks=4)
    counts = {r: [40, 2] for r in "abcdefg"} | {"h": [0, 0]}
    picked = []
    for i in range(12):
        candidates = [
            Candidate(r, inflight, waiting=waiting if signal == "waiting" else inflight)
            for r, (inflight, waiting) in counts.items()
        ]
        pick = strategy.pick(candidates, PickRequest(hashes(f"{i:04d} nothing shared")))
        assert pick is not None
        counts[pick.replica_id][0] += 1
        counts[pick.replica_id][1] += 1
        picked.append(pick.replica_id)
    assert [i + 1 for i, r in enumerate(picked) if r == "h"] == joined_at, picked
    assert counts["h"] == [to_new, to_new]
    if signal == "waiting":  # the other 8 arrivals: one each (4-10), then one more (12)
        assert sorted(n for r, (n, _) in counts.items() if r != "h") == [41] * 6 + [42]


@pytest.mark.parametrize("strategy", ["prefix", "least-load", "round-robin"])
def test_the_prefix_scorer_hashes_scores_and_learns_only_after_the_pick(strategy: str) -> None:
    index = PrefixIndex(100)
    routing = RoutingSpec(strategy=strategy, prefix_block_chars=4)
    chosen = build_strategy(routing, index, load_penalty_blocks=4.0, model="m", max_prompt_blocks=2)
    # Whole 4-char blocks chained over the model name, at most max_prompt_blocks of them.
    prompt = chosen.prefix.hashes({"model": "m", "prompt": "SSSSaaaabbbbcc"})
    assert prompt == block_hashes("SSSSaaaabbbbcc", model="m", block_chars=4, max_blocks=2) == hashes("SSSSaaaa")
    chat = chosen.prefix.hashes({"messages": [{"role": "user", "content": "hi"}]})
    assert chat == block_hashes("<|user|>\nhi<|end|>\n", model="m", block_chars=4, max_blocks=2)
    request = PickRequest(prompt)
    first = chosen.pick(cands(a=0, b=0), request)
    assert first is not None and first.matched_blocks == 0
    assert index.entries() == 0, "scoring and picking never teach the index"
    chosen.learn(first, request)
    assert index.matched_blocks(first.replica_id, prompt) == 2
    again = chosen.pick(cands(a=0, b=0), request)
    assert again is not None
    if strategy == "prefix":  # the holder wins, and the match comes from the scorer's own count
        assert again.replica_id == first.replica_id and again.matched_blocks == 2 and again.match_ratio == 1.0
    else:  # the other strategies do not score prefixes but report the pick's match the same way
        assert again.matched_blocks == index.matched_blocks(again.replica_id, prompt)
