"""bench/routing_sim.py's model of a router that restarts with KV events: the engines' event batches, the
view a replay rebuilds from a publisher's buffer, and how that view is scored.

Block hashes here are small ints; a prompt is its chain of blocks, so ``[1, 2, 3, 4]`` extends ``[1, 2, 3]``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "routing_sim.py"


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("routing_sim", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def first_batches(sim: ModuleType, engines: list, replay: object, now: float) -> list[int]:
    return [replay.first_batch(e.published(now)) for e in engines]  # type: ignore[attr-defined]


def test_batches_are_counted_per_step_per_storing_prefill_and_per_eviction(sim: ModuleType) -> None:
    def at(steps: int) -> float:
        return (steps + 0.5) * sim.EVENT_STEP_S  # mid-step: no float edge

    engine = sim.Engine(cache_blocks=4, slots=1)
    assert engine.published(at(10)) == 10  # decode steps alone, counted by time
    engine.insert([1, 2, 3], now=at(10))  # stores 3 blocks: one batch, number 10
    assert engine.published(at(10)) == 11
    assert dict(engine.cache) == {3: 10, 2: 10, 1: 10}
    engine.insert([1, 2], now=at(20))  # all hit: nothing stored, no batch
    assert engine.published(at(20)) == 21
    # stores 4 and 5 (batch 30 + 1 earlier = 31), then evicts the least recent, 5 (batch 32)
    engine.insert([1, 2, 3, 4, 5], now=at(30))
    assert engine.published(at(30)) == 33
    assert list(engine.cache.items()) == [(4, 31), (3, 10), (2, 10), (1, 10)]
    assert 5 not in engine.parent and engine.parent[4] == 3 and engine.parent[1] is None


def test_reported_hits_are_announced_again(sim: ModuleType) -> None:
    engine = sim.Engine(cache_blocks=8, slots=1)
    engine.report_hits = True
    engine.insert([1, 2], now=0.0)
    engine.insert([1, 2], now=1.0)  # all hit: one batch naming both again
    later = engine.published(1.0) - 1
    assert engine.cache == {1: later, 2: later}
    assert later > 0


def test_a_buffer_that_holds_every_batch_gives_the_engines_exact_caches(sim: ModuleType) -> None:
    engines = [sim.Engine(cache_blocks=4, slots=1) for _ in range(2)]
    engines[0].insert([1, 2, 3], now=0.0)
    engines[0].insert([7, 8], now=1.0)  # evicts 3
    assert list(engines[0].cache) == [2, 1, 8, 7]
    engines[1].insert([1, 2, 3, 4], now=2.0)
    first = first_batches(sim, engines, sim.Replay(10_000), now=3.0)
    assert first == [0, 0]  # batch 0 still buffered: complete
    index = sim.ReplayedCacheIndex(100, engines, first)
    index.record("0", [1, 2, 3, 4])  # the learned index guesses replica 0 holds more: a complete view is the truth
    for prompt in ([1, 2, 3, 4], [7, 8, 9], [1, 5], [9]):
        for i, e in enumerate(engines):
            assert index.matched_blocks(str(i), prompt) == e.hit_blocks(prompt)
    assert index.matched_blocks("0", [1, 2, 3, 4]) == 2
    assert index.held_anywhere(7) and index.held_anywhere(3)  # 3: evicted on replica 0, held on 1
    assert not index.held_anywhere(9)


def test_a_one_batch_buffer_lacks_a_prefix_stored_earlier_and_still_cached(sim: ModuleType) -> None:
    engine = sim.Engine(cache_blocks=100, slots=1)
    engine.insert([1, 2, 3], now=0.0)  # the hot prefix, stored once
    engine.insert([1, 2, 3], now=1.0)  # hit: not stored again
    engine.insert([1, 2, 3, 4, 5], now=2.0)  # a continuation: stores 4 and 5 in the last batch
    engine.insert([6, 7], now=2.0)  # another prompt, its own batch (the last)
    first = first_batches(sim, [engine], sim.Replay(1), now=2.0)  # restarts right after the last batch
    assert first[0] > 0  # partial
    index = sim.ReplayedCacheIndex(100, [engine], first)
    assert engine.hit_blocks([1, 2, 3]) == 3
    assert index.view_matched(0, [1, 2, 3]) == 0  # stored before the buffer, still cached: missing
    assert index.view_matched(0, [6, 7]) == 2  # stored in the buffered batch
    # 4 and 5 were stored within the buffer but under a parent that was not: no leading match, and
    # unusable for the router's view (CacheView skips a block whose parent it does not hold)
    assert index.view_matched(0, [1, 2, 3, 4, 5]) == 0
    assert engine.chained_from(first[0]) == 2  # 6 and 7 only
    assert engine.chained_from(0) == 7
    # a partial view is scored as the larger of it and the learned index
    assert index.matched_blocks("0", [1, 2, 3, 4]) == 0
    index.record("0", [1, 2])
    assert index.matched_blocks("0", [1, 2, 3, 4]) == 2
    assert index.matched_blocks("0", [6, 7, 8]) == 2
    assert index.held_anywhere(1) and index.held_anywhere(6) and not index.held_anywhere(4)


def test_without_replay_the_view_starts_empty_then_tracks_new_stores_and_evictions(sim: ModuleType) -> None:
    engine = sim.Engine(cache_blocks=4, slots=1)
    engine.insert([1, 2, 3], now=0.0)
    first = first_batches(sim, [engine], sim.Replay(None), now=1.0)
    assert first == [engine.published(1.0)]
    index = sim.ReplayedCacheIndex(100, [engine], first)
    assert index.view_matched(0, [1, 2, 3]) == 0
    engine.insert([5, 6], now=1.5)  # stored after the restart: seen; evicts the LRU tail (3)
    assert index.view_matched(0, [5, 6]) == 2
    engine.insert([8, 9, 10, 11], now=2.0)  # evicts 5 and 6 (and the rest): the view drops them too
    assert index.view_matched(0, [5, 6]) == 0
    assert index.view_matched(0, [8, 9, 10, 11]) == 4


def test_the_restart_reports_what_its_views_hold(sim: ModuleType) -> None:
    engines = [sim.Engine(cache_blocks=100, slots=1) for _ in range(2)]
    engines[0].insert([1, 2], now=0.0)
    engines[1].insert([3, 4], now=5.0)
    built: list[list[int]] = []

    def build(es: list, first: list[int]) -> object:
        built.append(first)
        return lambda req, loads: 0

    _, complete = sim.replayed_restart(build, sim.Replay(1_000_000))(engines, 6.0)
    assert complete["restart_views_complete"] == 1.0 and complete["restart_view_usable_share"] == 1.0
    assert built[-1] == [0, 0]
    # 1,000 batches at 7 ms a step hold the last ~7 s: engine 1's store at 5 s, not engine 0's at 0 s
    _, partial = sim.replayed_restart(build, sim.Replay(1_000))(engines, 9.0)
    assert partial["restart_views_complete"] == 0.0
    assert partial["restart_view_share"] == 0.5 and partial["restart_view_usable_share"] == 0.5
    _, none = sim.replayed_restart(build, sim.Replay(None))(engines, 9.0)
    assert none["restart_view_share"] == 0.0 and none["restart_horizon_s"] == 0.0
