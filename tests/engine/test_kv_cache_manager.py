"""The KV-cache manager between the scheduler and the block pool, with blocks of 4 tokens so every
count can be checked by hand (no model)."""

from __future__ import annotations

from kvfleet.engine.block_pool import BlockPool, root_hash
from kvfleet.engine.kv_cache_manager import KVCacheManager, pool_size_blocks
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.sequence import Sequence


def manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), 4, root_hash("t"))


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), 0.0)


def admit_and_compute(kv: KVCacheManager, s: Sequence) -> None:
    """Admit ``s`` with its cached prefix and act as the model: every token computed."""
    hits = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, s.num_tokens - len(hits) * 4, computed_blocks=hits)
    s.num_computed_tokens = s.num_tokens
    kv.cache_computed_blocks(s)


def test_pool_size_from_memory_capped_by_use() -> None:
    sizes = dict(kv_bytes_per_token=1024, block_size_tokens=16, max_num_seqs=2, max_model_len_tokens=100)
    assert pool_size_blocks(num_kv_blocks=7, kv_cache_memory_bytes=1 << 30, **sizes) == 7
    # 64 KiB / (1 KiB * 16) = 4 blocks by memory; 2 sequences * ceil(100 / 16) = 14 by use.
    assert pool_size_blocks(num_kv_blocks=0, kv_cache_memory_bytes=64 * 1024, **sizes) == 4
    assert pool_size_blocks(num_kv_blocks=0, kv_cache_memory_bytes=1 << 30, **sizes) == 14
    assert pool_size_blocks(num_kv_blocks=0, kv_cache_memory_bytes=1, **sizes) == 1


def test_a_cached_prefix_is_found_but_the_last_token_is_always_computed() -> None:
    kv = manager(8)
    first = seq("a", list(range(10, 22)))  # 12 tokens = 3 full blocks
    admit_and_compute(kv, first)
    assert kv.pool.num_cached == 3 and first.num_registered_blocks == 3
    same = seq("b", list(range(10, 22)))
    # All 3 blocks are cached, but the last token's logits are needed: only 2 count as computed.
    assert kv.get_computed_blocks(same) == first.block_table[:2]
    longer = seq("c", [*range(10, 22), 99])
    assert kv.get_computed_blocks(longer) == first.block_table[:3]
    assert kv.pool.num_free == 5, "looking up changes nothing in the pool"


def test_allocate_slots_refuses_without_changing_anything() -> None:
    kv = manager(3)
    a = seq("a", list(range(8)))
    assert kv.allocate_slots(a, 8, computed_blocks=[])  # 2 blocks
    b = seq("b", list(range(50, 58)))
    assert kv.blocks_needed(b, 8, computed_blocks=[]) == 2
    assert not kv.allocate_slots(b, 8, computed_blocks=[])
    assert b.block_table == [] and kv.num_free_blocks == 1
    # A running sequence grows by the blocks its new tokens cross into: position 8 needs a third.
    a.num_computed_tokens = 8
    assert kv.blocks_needed(a, 1) == 1
    assert kv.allocate_slots(a, 1) and len(a.block_table) == 3 and kv.num_free_blocks == 0
    assert kv.blocks_needed(a, 3) == 0, "positions 9-11 fit the third block"


def test_sharing_a_cached_block_from_the_free_list_costs_a_free_block() -> None:
    kv = manager(3)
    a = seq("a", list(range(9)))  # 2 full blocks + 1 token
    admit_and_compute(kv, a)
    kv.free(a)
    assert a.block_table == [] and kv.num_free_blocks == 3 and kv.pool.num_cached == 2
    b = seq("b", [*range(8), 77])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    # The 2 cached blocks sit in the free list, plus 1 new block for token 8: all 3.
    assert kv.blocks_needed(b, 1, computed_blocks=hits) == 3
    assert kv.allocate_slots(b, 1, computed_blocks=hits)
    assert b.block_table[:2] == hits and b.num_registered_blocks == 2 and kv.num_free_blocks == 0


def test_only_full_computed_blocks_become_findable() -> None:
    kv = manager(4)
    s = seq("a", list(range(7)))
    assert kv.allocate_slots(s, 7, computed_blocks=[])
    s.num_computed_tokens = 3  # a chunk of 3: no full block yet
    kv.cache_computed_blocks(s)
    assert kv.pool.num_cached == 0
    s.num_computed_tokens = 7
    kv.cache_computed_blocks(s)
    assert kv.pool.num_cached == 1 and s.num_registered_blocks == 1


def test_events_are_taken_once() -> None:
    kv = KVCacheManager(BlockPool(2, record_events=True), 4, root_hash("t"))
    admit_and_compute(kv, seq("a", list(range(5))))
    taken = kv.take_events()
    assert [e["type"] for e in taken] == ["BlockStored"]
    assert kv.take_events() == []
