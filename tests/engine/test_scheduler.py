"""Scheduling decisions with small, hand-checkable pools and budgets (no model)."""

from __future__ import annotations

from kvfleet.engine.block_pool import BlockPool, root_hash
from kvfleet.engine.kv_cache_manager import KVCacheManager
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvfleet.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int, block: int = 4, seqs: int = 8, budget: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(seqs, budget), KVCacheManager(BlockPool(num_blocks), block, root_hash("t")))


def seq(request_id: str, prompt_len: int, first_token: int = 1) -> Sequence:
    return Sequence(request_id, list(range(first_token, first_token + prompt_len)), SamplingParams(), 0.0)


def step(s: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """Schedule, then act as the model: advance counts and append a token where one is sampled."""
    out = s.schedule()
    s.after_step(out.chunks)
    for c in out.chunks:
        if c.samples:
            c.seq.token_ids.append(next_token)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_long_prompt_is_chunked_under_the_budget() -> None:
    s = make(16, budget=8)
    a = seq("a", 20)
    s.add(a)
    assert plan(step(s)) == [("a", 0, 8)]
    assert plan(step(s)) == [("a", 8, 8)]
    last = step(s)
    assert plan(last) == [("a", 16, 4)] and last.chunks[0].samples
    assert plan(step(s)) == [("a", 20, 1)]  # decoding
    assert len(a.block_table) == 6  # 22 tokens -> 6 blocks of 4


def test_decodes_first_then_new_prompt_takes_the_rest_of_the_budget() -> None:
    s = make(16, budget=8)
    a = seq("a", 3)
    s.add(a)
    step(s)
    s.add(seq("b", 10, first_token=50))
    assert plan(step(s)) == [("a", 3, 1), ("b", 0, 7)]
    assert plan(step(s)) == [("a", 4, 1), ("b", 7, 3)]


def test_max_num_seqs_bounds_running() -> None:
    s = make(16, seqs=2, budget=64)
    for name in "abc":
        s.add(seq(name, 2))
    step(s)
    assert [q.request_id for q in s.running] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"]


def test_out_of_blocks_preempts_the_newest_and_it_resumes_later() -> None:
    s = make(4, budget=64)  # 16 token slots
    a, b = seq("a", 7), seq("b", 7, first_token=100)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 2 blocks each (8 slots), 7 tokens computed, 1 sampled
    assert s.kv_cache.pool.num_free == 0
    assert plan(step(s)) == [("a", 7, 1), ("b", 7, 1)]  # position 7 still fits in block 2
    out = step(s)  # a's position 8 needs a third block: b (the newest) is preempted
    assert [p.request_id for p in out.preempted] == ["b"]
    assert "KV pool full" in out.preempted[0].reason
    assert plan(out) == [("a", 8, 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(s.waiting) == [b], "the preempted sequence is first in line"
    assert b.token_ids == [*range(100, 107), 7, 7], "its generated tokens are kept and recomputed"
    for _ in range(20):
        if not s.has_work():
            break
        for c in step(s).chunks:
            if c.seq.num_output_tokens >= 3:
                s.finish(c.seq, "length")
    assert a.status is SequenceStatus.FINISHED
    assert b.status is SequenceStatus.FINISHED and b.num_preemptions == 1


def test_admission_waits_when_the_first_chunk_does_not_fit() -> None:
    s = make(2, budget=64)  # 8 token slots
    s.add(seq("a", 6))
    s.add(seq("b", 6, first_token=40))
    out = step(s)
    assert plan(out) == [("a", 0, 6)]
    assert not out.preempted and [q.request_id for q in s.waiting] == ["b"]


def test_prefix_hits_skip_cached_blocks_and_count_tokens() -> None:
    s = make(16, budget=64)
    a = seq("a", 10)  # blocks [1..4], [5..8] full, then 9, 10
    s.add(a)
    first = step(s)
    assert (first.prefix_queries_tokens, first.prefix_hits_tokens) == (10, 0)
    a_blocks = a.block_table[:2]
    s.finish(a, "stop")
    b = seq("b", 12)  # same first 8 tokens
    s.add(b)
    out = step(s)
    assert plan(out) == [("b", 8, 4)]
    assert (out.prefix_queries_tokens, out.prefix_hits_tokens) == (12, 8)
    assert b.block_table[:2] == a_blocks, "the cached blocks themselves are shared"
    assert b.num_cached_prompt_tokens == 8
