"""Block pool bookkeeping with hand-checkable numbers (no tensors)."""

from __future__ import annotations

import pytest

from kvfleet.engine.block_pool import BlockPool, BlockPoolExhaustedError, chain_block_hashes, root_hash


def test_hashes_chain_and_are_seeded_by_model() -> None:
    tokens = list(range(10))
    a = chain_block_hashes(root_hash("m"), tokens, 4)
    assert len(a) == 2, "the partial third block (tokens 8, 9) is not hashed"
    assert a == chain_block_hashes(root_hash("m"), tokens, 4)
    assert chain_block_hashes(root_hash("other"), tokens, 4) != a
    changed = chain_block_hashes(root_hash("m"), [99, *tokens[1:]], 4)
    assert changed[0] != a[0] and changed[1] != a[1], "a change in block 0 changes every later hash"
    same_first = chain_block_hashes(root_hash("m"), [*tokens[:4], 50, 51, 52, 53], 4)
    assert same_first[0] == a[0] and same_first[1] != a[1]


def test_lru_evicts_oldest_free_cached_block_first() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.register(0, b"h0")
    pool.register(1, b"h1")
    pool.release([0, 1])  # tail first: free order becomes 2, 3, 1, 0
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.match_prefix([b"h0", b"h1"]) == [0, 1]
    assert pool.allocate(3) == [2, 3, 1]  # block 1 (the tail, h1) is evicted before block 0
    assert pool.num_evictions == 1
    assert pool.match_prefix([b"h0", b"h1"]) == [0]


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(3)
    pool.allocate(3)
    pool.register(0, b"h0")
    pool.release([0])
    pool.release([1])  # no hash: goes to the front
    assert pool.allocate(1) == [1]
    assert pool.match_prefix([b"h0"]) == [0]


def test_sharing_counts_references_and_usage() -> None:
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.register(b, b"h")
    pool.share([b])
    assert pool.blocks[b].ref_count == 2
    assert pool.usage() == 0.25
    pool.release([b])
    assert pool.usage() == 0.25, "still referenced once"
    pool.release([b])
    assert pool.usage() == 0.0
    assert pool.free_needed_to_share([b]) == 1
    pool.share([b])  # revived from the free list
    assert pool.num_free == 3


def test_duplicate_hash_keeps_first_block_and_disabled_cache_finds_nothing() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.register(a, b"same")
    pool.register(b, b"same")
    assert pool.match_prefix([b"same"]) == [a]
    off = BlockPool(2, enable_prefix_caching=False)
    [c] = off.allocate(1)
    off.register(c, b"x")
    assert off.match_prefix([b"x"]) == []


def test_over_allocation_is_an_error() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate(3)
