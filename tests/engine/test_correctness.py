"""The paged, batched engine gives the same greedy tokens as an unpaged single-sequence forward
(transformers' LlamaForCausalLM), with prefix hits and with preemption."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfleet.engine.sampling import SamplingParams

from .conftest import make_core, run_to_completion

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(count: int, seed: int = 1) -> dict[str, list[int]]:
    rng = random.Random(seed)
    # Different lengths across block boundaries (block size 16): 3 .. 70 tokens.
    return {f"r{i}": [rng.randrange(3, 1024) for _ in range(3 + 9 * i)] for i in range(count)}


@pytest.mark.slow
def test_eight_concurrent_batched_paged_match_unpaged_oracle(
    tiny_model_dir: Path, oracle: Callable[[list[int], int], list[int]]
) -> None:
    # A 32-token step budget forces chunked prefill of the longer prompts alongside decodes.
    core = make_core(tiny_model_dir, max_num_batched_tokens=32)
    prompts = _prompts(8)
    got = run_to_completion(core, prompts, GREEDY)
    for request_id, prompt in prompts.items():
        assert got[request_id] == oracle(prompt, GREEDY.max_tokens), request_id
    assert core.kv_cache.pool.usage() == 0.0, "finished sequences hold no blocks"


@pytest.mark.slow
def test_prefix_hit_computes_only_new_tokens(
    tiny_model_dir: Path, oracle: Callable[[list[int], int], list[int]]
) -> None:
    core = make_core(tiny_model_dir, max_num_batched_tokens=512)
    shared = [(7 * i) % 1000 + 3 for i in range(80)]  # 5 full blocks
    first = [*shared, 11, 12, 13]
    second = [*shared, 21, 22, 23, 24, 25]
    got_first = run_to_completion(core, {"a": first}, GREEDY)["a"]
    computed_before = core.total_prefill_computed_tokens
    assert computed_before == len(first)
    got_second = run_to_completion(core, {"b": second}, GREEDY)["b"]
    computed = core.total_prefill_computed_tokens - computed_before
    assert computed == len(second) - 80, "only the tokens after the 80-token shared prefix are computed"
    metrics = core.metrics
    assert metrics.prefix_cache_hits.labels("tiny")._value.get() == 80
    assert metrics.prefix_cache_queries.labels("tiny")._value.get() == len(first) + len(second)
    assert got_first == oracle(first, GREEDY.max_tokens)
    assert got_second == oracle(second, GREEDY.max_tokens)


def test_whole_prompt_cached_still_computes_last_token(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    prompt = list(range(100, 132))  # exactly 2 blocks
    a = run_to_completion(core, {"a": prompt}, GREEDY)["a"]
    before = core.total_prefill_computed_tokens
    b = run_to_completion(core, {"b": prompt}, GREEDY)["b"]
    # The last block is recomputed so its final token yields logits: 16 tokens, not 0.
    assert core.total_prefill_computed_tokens - before == 16
    assert a == b


@pytest.mark.slow
def test_tiny_pool_forces_preemption_and_outputs_still_match(
    tiny_model_dir: Path, oracle: Callable[[list[int], int], list[int]]
) -> None:
    # 12 blocks of 4 tokens = 48 token slots for 8 sequences of up to ~40 tokens each.
    core = make_core(tiny_model_dir, num_kv_blocks=12, block_size_tokens=4, max_num_batched_tokens=32)
    rng = random.Random(5)
    prompts = {f"p{i}": [rng.randrange(3, 1024) for _ in range(6 + 3 * i)] for i in range(8)}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = run_to_completion(core, prompts, params)
    assert core.metrics.num_preemptions.labels("tiny")._value.get() > 0, "the pool was meant to be too small"
    assert core.kv_cache.pool.num_evictions > 0
    for request_id, prompt in prompts.items():
        assert got[request_id] == oracle(prompt, params.max_tokens), request_id
    assert core.kv_cache.pool.usage() == 0.0


def test_without_prefix_caching_nothing_is_shared(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, enable_prefix_caching=False)
    prompt = list(range(200, 264))
    run_to_completion(core, {"a": prompt}, GREEDY)
    run_to_completion(core, {"b": prompt}, GREEDY)
    assert core.total_prefill_computed_tokens == 2 * len(prompt)


def test_stop_token_ids_and_eos_end_the_sequence(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    prompt = list(range(40, 60))
    free = run_to_completion(core, {"a": prompt}, GREEDY)["a"]
    stop_at = free[3]
    first = free.index(stop_at)
    stopped = run_to_completion(
        core, {"b": prompt}, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True)
    )["b"]
    assert stopped == free[: first + 1], "generation ends at (and includes) the stop token id"
    core.outputs.eos_ids = frozenset({stop_at})  # treat that token as EOS for this engine
    eos = run_to_completion(core, {"c": prompt}, SamplingParams(max_tokens=12, temperature=0.0))["c"]
    assert eos == free[: first + 1]
