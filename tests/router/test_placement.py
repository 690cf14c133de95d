"""Placement that several routers agree on: divergence keys, stable hashes, rendezvous ranking, and three
real ``Fleet`` objects (three routers) sending a conversation's turns to one replica."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfleet.router.fleet import Fleet
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.picking import BoundedLoadFilter, Candidate, PickRequest
from kvfleet.router.placement import BranchIndex, PlacementScorer, RendezvousRanker, home, stable_key
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import block_hashes
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec

BLOCK = 16


def chain(text: str) -> list[int]:
    return block_hashes(text, model="m", block_chars=BLOCK, max_blocks=1000)


SYSTEM = "S" * (3 * BLOCK)  # a shared system prompt of exactly 3 blocks


def conversation(name: str, turns: int, turn_blocks: int = 1) -> str:
    """A chat prompt: the shared system prompt, then this conversation's turns (``turn_blocks`` each)."""
    return SYSTEM + "".join(f"{name}-turn-{t}".ljust(BLOCK * turn_blocks, ".") for t in range(turns))


def test_the_divergence_block_follows_the_deepest_point_whose_branches_recur() -> None:
    branches = BranchIndex(max_entries=1000, max_depth_blocks=100)
    # Nothing known to branch yet, then a branch after the system prompt whose branches have not come
    # back: no key (an empty router routes as a lone router would).
    assert branches.observe(chain(conversation("a", 2))) == -1
    assert branches.observe(chain(conversation("b", 1))) == -1
    # Conversation "a" comes back with a later turn: the point after the system prompt leads to
    # conversations that recur, so block 3, each conversation's first own block, is the key.
    assert branches.observe(chain(conversation("a", 5))) == 3
    assert branches.observe(chain(conversation("c", 4))) == 3
    # One-off questions after a shared document never recur: the key stays at the document, not the question.
    doc = "I" * BLOCK + "D" * (3 * BLOCK)
    for q in ("q1", "q2", "q3"):
        assert branches.observe(chain(doc + q.ljust(BLOCK, "?"))) in (-1, 0)  # the root: docs vs chats
    # A second document: documents recur (q1-q3 came back to the first), so the key is the document.
    assert branches.observe(chain("I" * BLOCK + "E" * (3 * BLOCK) + "q".ljust(BLOCK, "?"))) == 0
    assert branches.observe(chain(doc + "q9".ljust(BLOCK, "?"))) == 1


def test_other_applications_on_the_same_router_do_not_hide_a_conversations_key() -> None:
    """Two applications with their own system prompts: the prompts branch at the root too, and the key
    is still each conversation's first own block."""
    branches = BranchIndex(1000, 100)
    other = "O" * (5 * BLOCK)
    for name in ("x", "y"):
        for turns in (1, 2):
            branches.observe(chain(conversation(name, turns)))
            branches.observe(chain(other + f"{name}{turns}".ljust(2 * BLOCK, "o")))
    assert branches.observe(chain(conversation("z", 3))) == 3


def test_a_later_turn_gets_the_first_turns_key_at_a_router_that_never_saw_the_first() -> None:
    first, second = BranchIndex(1000, 100), BranchIndex(1000, 100)
    for index, names in ((first, ("x", "y")), (second, ("p", "q", "r"))):  # each saw other conversations
        for turns in (1, 2):
            for name in names:
                index.observe(chain(conversation(name, turns)))
    turn1, turn4 = chain(conversation("c", 1)), chain(conversation("c", 4))
    assert home(first, turn1) == home(second, turn4) == (stable_key(turn1, 3), 3)


def test_no_key_for_prompts_diverging_at_their_first_block_or_with_nothing_known() -> None:
    branches = BranchIndex(1000, 100)
    assert home(branches, chain(conversation("a", 1))) == (None, 0)  # nothing known yet
    assert home(branches, []) == (None, 0)
    for tenant in ("T", "U", "T", "U"):  # tenants recur, but at the root: the index places them
        assert home(branches, chain(tenant * (2 * BLOCK) + "question")) == (None, 0)


def test_branch_index_is_bounded_in_entries_and_depth() -> None:
    branches = BranchIndex(max_entries=50, max_depth_blocks=4)
    assert branches.observe(chain("A" * (40 * BLOCK))) == -1
    assert branches.entries() == 5  # the root and blocks 0..3 (the walk stops at depth 4)
    assert branches.observe(chain("A" * (40 * BLOCK))) == -1  # the same prompt again: no branch
    # A branch deeper than the depth bound is never seen: no key.
    assert branches.observe(chain("A" * (10 * BLOCK) + "B" * (30 * BLOCK))) == -1
    for i in range(200):
        branches.observe(chain(f"{i:04d}".ljust(BLOCK, "x") + "tail" * 20))
    assert branches.entries() <= 50
    with pytest.raises(ValueError, match="max_entries"):
        BranchIndex(0, 1)
    with pytest.raises(ValueError, match="max_depth_blocks"):
        BranchIndex(1, 0)


def test_stable_hash_is_the_same_in_another_process_and_block_hashes_are_not() -> None:
    text = conversation("c", 3)
    code = (
        "from kvfleet.router.prompt import block_hashes as b;"
        f"h = b({text!r}, model='m', block_chars={BLOCK}, max_blocks=1000);"
        "print(h.stable_hash(3), h[3])"
    )
    out = [
        subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert out[0][0] == out[1][0] == str(chain(text).stable_hash(3))
    assert out[0][1] != out[1][1]  # the per-process keyed hash differs: it cannot be the placement key
    # The stable hash covers the text up to the end of the block, and only that.
    assert chain(text).stable_hash(2) == chain(SYSTEM + "other").stable_hash(2)
    assert chain(text).stable_hash(3) != chain(conversation("d", 3)).stable_hash(3)
    with pytest.raises(IndexError):
        chain(text).stable_hash(99)


def test_rendezvous_ranking_is_shared_and_moves_only_a_leaving_replicas_keys() -> None:
    ids = [f"r{i}" for i in range(8)]
    one, two = RendezvousRanker(), RendezvousRanker()
    winners = {}
    for key in range(2000):
        ranked_one = max(ids, key=lambda r, k=key: one.weight(k, r))
        assert ranked_one == max(ids, key=lambda r, k=key: two.weight(k, r))
        winners[key] = ranked_one
    counts = {r: sum(1 for w in winners.values() if w == r) for r in ids}
    assert min(counts.values()) > 2000 / 8 * 0.7, counts  # spread evenly (each ~250)
    left = [r for r in ids if r != "r3"]
    for key, winner in winners.items():
        now = max(left, key=lambda r, k=key: one.weight(k, r))
        if winner != "r3":
            assert now == winner  # only r3's keys move


def test_placement_scorer_credits_the_home_with_the_prompts_own_part() -> None:
    hashes = chain(conversation("c", 5))  # 8 blocks: 3 of system prompt, 5 of this conversation
    ranker = RendezvousRanker()
    candidates = [Candidate(f"r{i}", 0) for i in range(4)]
    key = 12345
    home_at = max(range(4), key=lambda i: ranker.weight(key, f"r{i}"))
    request = PickRequest(hashes, home_key=key, home_block=3)
    index = PrefixIndex(100)
    # The index knows nothing of the home: it is credited with the conversation's own 5 blocks.
    assert PlacementScorer(index, ranker).score(candidates, request) == [5.0 if i == home_at else 0.0 for i in range(4)]
    # The index knows it holds 6 blocks (earlier turns this router sent there): credited with the other 2.
    index.record(f"r{home_at}", hashes[:6])
    assert PlacementScorer(index, ranker).score(candidates, request) == [2.0 if i == home_at else 0.0 for i in range(4)]
    assert PlacementScorer(index).score(candidates, PickRequest(hashes)) == [0.0] * 4  # no key, no credit


def test_load_bound_slack_adds_requests_to_the_cap() -> None:
    candidates = [Candidate("a", 3), Candidate("b", 1), Candidate("c", 1), Candidate("d", 2)]
    # ceil(1.25 x (7 + 1) / 4) = ceil(2.5) = 3: "a" (3 + 1 > 3) is dropped; with a slack of 1 it is kept.
    assert [c.replica_id for c in BoundedLoadFilter(1.25).filter(candidates, PickRequest())] == ["b", "c", "d"]
    assert len(BoundedLoadFilter(1.25, slack=1).filter(candidates, PickRequest())) == 4


async def make_fleet(placement: bool) -> tuple[Fleet, StaticReplicaSource]:
    fleet = Fleet(RouterSettings(placement=placement), NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=BLOCK))
    for i in range(4):
        source.add("m", f"r{i}", f"http://127.0.0.1:{9000 + i}")
    await source.start(fleet)
    return fleet, source


async def test_three_routers_send_every_turn_of_a_conversation_to_one_replica() -> None:
    """Each turn of 12 conversations reaches a different router than the turn before (as a Service
    spreads them); with placement every router picks the replica the first turn went to. A turn is 4
    blocks, the system prompt 3: even the first turn's own part outweighs the shared prompt cached
    elsewhere, so it goes home too."""
    routers = [(await make_fleet(placement=True))[0] for _ in range(3)]
    assert await picks_per_conversation(routers) == [1] * 12
    # Every conversation turn had a home (72), and so had the warm-ups' second turns (2 + 3 + 4).
    keyed = sum(f._metrics.placement_keyed.collect().samples[0].value for f in routers)
    assert keyed == 72 + 9
    # The same without placement: each router's index says the system prompt is where its own first
    # requests went, and the turns follow that, a different replica per router.
    plain = [(await make_fleet(placement=False))[0] for _ in range(3)]
    assert max(await picks_per_conversation(plain)) > 1


async def picks_per_conversation(routers: list[Fleet]) -> list[int]:
    """How many replicas each of 12 conversations' turns went to, each turn through the next router."""
    for r, fleet in enumerate(routers):
        # Router r saw two turns of r + 2 other conversations while r requests were in flight: the
        # routers' indexes differ (the system prompt is cached where each one's first requests went),
        # and each knows that conversations branch off after the system prompt and come back.
        held = [fleet.try_acquire("m", chain(f"held{i}".ljust(BLOCK * 2, "h"))) for i in range(r)]
        for turns in (1, 2):
            for n in range(r + 2):
                lease = fleet.try_acquire("m", chain(conversation(f"warm{r}-{n}", turns, turn_blocks=4)))
                lease.release("ok")  # type: ignore[union-attr]
        for lease in held:
            lease.release("ok")  # type: ignore[union-attr]
    spread = []
    for c in range(12):
        picked = []
        for turn in range(1, 7):
            fleet = routers[(c + turn) % 3]
            lease = fleet.try_acquire("m", chain(conversation(f"conv{c}", turn, turn_blocks=4)))
            assert lease is not None
            picked.append(lease.replica_id)
            lease.release("ok")
        spread.append(len(set(picked)))
    for fleet in routers:
        await fleet.close()
    return spread


async def test_without_placement_or_a_known_branch_the_pick_is_the_index_and_load_alone() -> None:
    placed, _ = await make_fleet(placement=True)
    plain, _ = await make_fleet(placement=False)
    # An empty router knows no branch point: it picks exactly as a router without placement.
    for n in range(3):
        hashes = chain(f"{n}".ljust(BLOCK, "z") * 4)
        a, b = placed.try_acquire("m", hashes), plain.try_acquire("m", hashes)
        assert a is not None and b is not None
        assert a.replica_id == b.replica_id
        assert a.pick.score == b.pick.score
    await placed.close()
    await plain.close()
