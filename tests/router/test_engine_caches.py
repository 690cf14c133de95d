"""Event views as the prefix scorer reads them: when a view is used, and in which unit (hand-checkable)."""

from __future__ import annotations

from kvfleet.router.engine_caches import EngineCaches, ReplicaEvents
from kvfleet.router.kv_events import BlockStored, CacheView, EventBatch, token_block_hashes
from kvfleet.router.picking import Candidate, PickRequest, PrefixScorer
from kvfleet.router.prefix_index import PrefixIndex

TOKENS = list(range(1, 17))  # 4 blocks of 4


def stored(tokens: list[int], first_hash: int = 100) -> EventBatch:
    blocks = len(tokens) // 4
    return EventBatch(0.0, (BlockStored(tuple(range(first_hash, first_hash + blocks)), None, tuple(tokens), 4),))


def test_a_view_from_the_first_batch_is_complete_one_joined_later_is_not() -> None:
    state = ReplicaEvents(CacheView(100))
    assert not state.usable, "nothing connected yet"
    state.on_connected()
    assert not state.usable, "connected, but no batch yet"
    assert state.on_batch(0, stored(TOKENS))[0] == "first"
    assert state.usable and state.view.complete
    late = ReplicaEvents(CacheView(100))
    late.on_connected()
    late.on_batch(7, stored(TOKENS))
    assert late.usable and not late.view.complete


def test_gaps_restarts_and_reconnections() -> None:
    state = ReplicaEvents(CacheView(100))
    state.on_connected()
    state.on_batch(0, stored(TOKENS))
    assert state.on_batch(2, stored([9] * 4, 200))[0] == "gap"
    assert not state.view.complete and len(state.view) == 5, "a gap keeps what is known"
    assert state.on_batch(0, stored([8] * 4, 300))[0] == "restart"
    assert state.view.complete and len(state.view) == 1, "a restarted engine's cache starts empty"
    state.on_disconnected()
    assert not state.usable
    state.on_connected()
    # The number expected from the old process: it may as well be a new process's (both count from 0).
    assert state.on_batch(1, stored([7] * 4, 400))[0] == "resync"
    assert not state.view.complete and len(state.view) == 1, "after a reconnection the view starts over"
    state.on_disconnected()
    state.on_connected()
    assert state.on_batch(9, stored([6] * 4, 500))[0] == "resync"
    assert not state.view.complete and len(state.view) == 1
    state.on_disconnected()
    state.on_connected()
    assert state.on_batch(0, stored([5] * 4, 600))[0] == "restart"
    assert state.view.complete and len(state.view) == 1, "a new process from its first batch: complete"


def test_matched_credit_in_text_blocks() -> None:
    caches = EngineCaches(100)
    complete = caches.add("a")
    complete.on_connected()
    complete.on_batch(0, stored(TOKENS[:8]))  # holds 2 of the prompt's 4 token blocks
    partial = caches.add("b")
    partial.on_connected()
    partial.on_batch(5, stored(TOKENS[:4]))  # joined late: holds 1, may hold more
    caches.add("c")  # never connected
    tokens = token_block_hashes(TOKENS, 4)
    # The prompt is 10 text blocks: 2 of 4 token blocks is 5 of them.
    assert caches.matched("a", tokens, 4, 10, learned=9) == 5.0, "a complete view overrides the index's guess"
    assert caches.matched("b", tokens, 4, 10, learned=1) == 2.5
    assert caches.matched("b", tokens, 4, 10, learned=7) == 7.0, "a partial view: the larger of the two"
    assert caches.matched("c", tokens, 4, 10, learned=3) == 3.0, "no usable view: the index"
    assert caches.matched("zz", tokens, 4, 10, learned=3) == 3.0
    assert caches.matched("a", tokens, 8, 10, learned=3) == 3.0, "another block size: the index"
    assert caches.block_size() == 4 and caches.usable_count() == 2 and caches.blocks() == 3
    assert caches.held_anywhere(tokens[0]) and not caches.held_anywhere(tokens[3])


def test_prefix_scorer_prefers_what_engines_hold_over_what_the_index_guesses() -> None:
    index = PrefixIndex(1000)
    text = list(range(500, 510))  # 10 text blocks
    index.record("a", text)  # this router sent the prompt to a once; a has evicted it since
    caches = EngineCaches(100)
    # a holds another prompt only; b holds this one whole: another router sent it there.
    for replica, tokens in (("a", [99] * 4), ("b", TOKENS)):
        state = caches.add(replica)
        state.on_connected()
        state.on_batch(0, stored(tokens))
    candidates = [Candidate("a", 0), Candidate("b", 0)]
    request = PickRequest(text, engine_blocks=token_block_hashes(TOKENS, 4), engine_block_size=4)
    assert PrefixScorer(index, caches).score(candidates, request) == [0.0, 10.0]
    assert PrefixScorer(index).score(candidates, request) == [10.0, 0.0], "without events: the index"
    assert PrefixScorer(index, caches).score(candidates, PickRequest(text)) == [10.0, 0.0], "not tokenized"
