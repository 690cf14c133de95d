"""Prompt rendering, chained block hashes and the per-replica prefix index (block size 4, checkable by hand)."""

from __future__ import annotations

import random
import re

import pytest

from kvfleet.router.errors import BadRequestError
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import block_hashes, render_prompt


def hashes(text: str, model: str = "m") -> list[int]:
    return block_hashes(text, model=model, block_chars=4, max_blocks=100)


def test_only_whole_blocks_are_hashed() -> None:
    assert len(hashes("abc")) == 0
    assert len(hashes("abcd")) == 1
    assert len(hashes("abcdefghij")) == 2  # "ij" is a partial block


def test_hashes_chain_over_the_whole_prefix() -> None:
    a = hashes("abcdefgh")
    b = hashes("abcdefgX")
    c = hashes("Xbcdefgh")
    assert a[0] == b[0] and a[1] != b[1]  # same first block, different second
    assert a[0] != c[0] and a[1] != c[1]  # second block text equal, but its prefix differs


def test_hashes_are_seeded_by_model() -> None:
    assert hashes("abcd", model="m1") != hashes("abcd", model="m2")


def test_max_blocks_bounds_the_work() -> None:
    assert len(block_hashes("x" * 1000, model="m", block_chars=4, max_blocks=7)) == 7


def test_chat_rendering_is_stable_and_extends_with_turns() -> None:
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "yo"}]}
    r1, r2 = render_prompt(turn1), render_prompt(turn2)
    assert r1 == "<|system|>\nS<|end|>\n<|user|>\nhi<|end|>\n"
    assert r2.startswith(r1)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert render_prompt(parts) == "<|user|>\nhi<|end|>\n"


def test_completion_prompt_forms() -> None:
    assert render_prompt({"prompt": "hello"}) == "hello"
    assert render_prompt({"prompt": ["first", "second"]}) == "first"
    assert render_prompt({"prompt": [1, 2, 3]}) == "1 2 3"
    assert render_prompt({}) == ""


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": "hi"}, "'messages'"),
        ({"messages": ["hi"]}, "'messages[0]'"),
        ({"messages": [{"role": 3, "content": "x"}]}, "'messages[0].role'"),
        ({"messages": [{"role": "user", "content": 5}]}, "'messages[0].content'"),
        ({"prompt": 5}, "'prompt'"),
    ],
)
def test_malformed_prompts_name_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(BadRequestError, match=re.escape(field)):
        render_prompt(body)


def test_index_matches_leading_blocks_only() -> None:
    index = PrefixIndex(default_capacity_blocks=100)
    index.record("r1", hashes("abcdefgh"))
    assert index.matched_blocks("r1", hashes("abcdefgh")) == 2
    assert index.matched_blocks("r1", hashes("abcdefghijkl")) == 2
    assert index.matched_blocks("r1", hashes("abcdXXXXijkl")) == 1
    assert index.matched_blocks("r1", hashes("Xbcdefgh")) == 0
    assert index.matched_blocks("r2", hashes("abcdefgh")) == 0


def test_scoring_does_not_change_the_index() -> None:
    index = PrefixIndex(default_capacity_blocks=2)
    index.record("r1", hashes("aaaa"))
    index.record("r1", hashes("bbbb"))
    for _ in range(5):
        index.matched_blocks("r1", hashes("aaaa"))  # reads must not refresh "aaaa"
    index.record("r1", hashes("cccc"))
    assert index.matched_blocks("r1", hashes("aaaa")) == 0  # least recently recorded went first
    assert index.matched_blocks("r1", hashes("bbbb")) == 1


def test_lru_evicts_tails_before_shared_heads() -> None:
    index = PrefixIndex(default_capacity_blocks=3)
    index.record("r1", hashes("SSSSaaaa"))  # system block + one user block
    index.record("r1", hashes("SSSSbbbb"))  # 3 distinct blocks now: S, a, b
    index.record("r1", hashes("SSSScccc"))  # 4th distinct: evicts "a", keeps the shared head
    assert index.entries("r1") == 3
    assert index.matched_blocks("r1", hashes("SSSSaaaa")) == 1
    assert index.matched_blocks("r1", hashes("SSSScccc")) == 2


def test_per_replica_capacity_and_forgetting() -> None:
    index = PrefixIndex(default_capacity_blocks=10)
    index.set_capacity("small", 2)
    index.record("small", hashes("a" * 40))
    index.record("big", hashes("a" * 40))
    assert index.entries("small") == 2
    assert index.entries("big") == 10
    index.retain(["big"])
    assert index.replicas() == ["big"]
    assert index.entries() == 10
    index.forget("big")
    assert index.entries() == 0


def test_held_blocks_stay_prefix_closed_so_the_binary_search_equals_a_scan() -> None:
    """Many prompts sharing heads at random depths, through a small LRU that evicts all the time:
    every answer of the binary search equals a plain leading-block scan."""
    rng = random.Random(7)
    index = PrefixIndex(default_capacity_blocks=40)
    heads = ["".join(rng.choice("ab") for _ in range(4 * rng.randint(1, 12))) for _ in range(30)]
    prompts = [h + "".join(rng.choice("xyz") for _ in range(4 * rng.randint(0, 10))) for h in heads * 4]
    lru = index._lru  # the scan reads the same LRU the search does
    for n, prompt in enumerate(prompts):
        index.record(f"r{n % 2}", hashes(prompt))
        for other in rng.sample(prompts, 10):
            wanted = hashes(other)
            for replica in ("r0", "r1"):
                held = lru.get(replica, {})
                scan = next((i for i, h in enumerate(wanted) if h not in held), len(wanted))
                assert index.matched_blocks(replica, wanted) == scan
