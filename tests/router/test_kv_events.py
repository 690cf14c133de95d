"""vLLM KV-event batches decoded and applied: golden payloads, hand-built ones, and bad input."""

from __future__ import annotations

import msgpack
import pytest

from kvfleet.router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheView,
    DecodeLimits,
    EventBatch,
    KVEventError,
    SequenceCheck,
    decode_batch,
    decode_frames,
    token_block_hashes,
)

# Encoded by msgspec.msgpack.encode from structs declared as vLLM 0.33.0's vllm/distributed/kv_events.py
# declares them (KVEventBatch array_like; events tagged maps, omit_defaults): two sha256-sized hashes
# stored (group_idx=0, kv_cache_spec_kind and session_id set), one removed, then all cleared, rank 0.
GOLDEN_BYTES_HASHES = bytes.fromhex(
    "93cb41d954fc4010000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c420000102"
    "030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fc4200102030405060708090a0b0c0d0e0f1011121314"
    "15161718191a1b1c1d1e1f20b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa"
    "626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964"
    "7800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6eaa73657373696f6e5f6964a2733183"
    "a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c4200102030405060708090a0b0c0d0e0f1011"
    "12131415161718191a1b1c1d1e1f20a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400"
)
# The same encoder: int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), a parent, a LoRA and extra_keys.
GOLDEN_INT_HASHES_LORA = bytes.fromhex(
    "93cb400000000000000091de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b0cb17061"
    "72656e745f626c6f636b5f6861736807a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f69"
    "64c0a66d656469756da3475055a96c6f72615f6e616d65a761646170746572aa65787472615f6b6579739291a7616461707465"
    "72c0c0"
)

H1, H2, H3 = bytes(range(32)), bytes(range(1, 33)), bytes(range(2, 34))


def stored(hashes, parent, tokens, block_size=4, **extra):
    event = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(extra)
    return event


def batch(*events, ts=1.0, rank=None) -> bytes:
    return msgpack.packb([ts, list(events), rank])


def test_golden_payload_from_vllm_struct_definitions() -> None:
    got = decode_batch(GOLDEN_BYTES_HASHES)
    assert got.ts == 1700000000.25
    assert got.data_parallel_rank == 0
    assert got.events == (
        BlockStored((H1, H2), None, (1, 2, 3, 4, 5, 6, 7, 8), 4, None, "GPU", None, False, 0),
        BlockRemoved((H2,), "GPU", None),
        AllBlocksCleared(),
    )
    lora = decode_batch(GOLDEN_INT_HASHES_LORA).events[0]
    assert isinstance(lora, BlockStored)
    assert (lora.block_hashes, lora.parent_block_hash, lora.lora_name, lora.has_extra_keys) == (
        (11, 12),
        7,
        "adapter",
        True,
    )


def test_array_like_events_of_older_releases() -> None:
    payload = msgpack.packb(
        [
            2.5,
            [
                ["BlockStored", [H1], None, [9, 8, 7, 6], 4, None, "GPU"],
                ["BlockRemoved", [H1], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    got = decode_batch(payload)
    assert got.events == (
        BlockStored((H1,), None, (9, 8, 7, 6), 4, None, "GPU"),
        BlockRemoved((H1,), "GPU"),
        AllBlocksCleared(),
    )
    assert got.data_parallel_rank is None


@pytest.mark.parametrize(
    ("payload", "reason", "words"),
    [
        (b"\xc1", "malformed", "msgpack"),  # a reserved byte
        (msgpack.packb([1.0, [], 0]) + b"\x00", "malformed", "msgpack"),  # trailing bytes
        (msgpack.packb({"ts": 1.0}), "malformed", "array"),
        (msgpack.packb([1.0]), "malformed", "array"),
        (msgpack.packb(["now", []]), "malformed", "ts"),
        (msgpack.packb([1.0, {}]), "malformed", "events"),
        (msgpack.packb([1.0, [], "zero"]), "malformed", "data_parallel_rank"),
        (batch({"type": "BlockEvicted", "block_hashes": []}), "unknown-event", "BlockEvicted"),
        (batch(42), "malformed", "event 0"),
        (batch(stored([H1], None, [1, 2, 3])), "malformed", "3 token ids for 1 blocks of 4"),
        (batch(stored([H1], None, [1, 2, 3, 4], block_size=0, token_ids=[])), "malformed", "block_size"),
        (batch(stored(["h1"], None, [1, 2, 3, 4])), "malformed", "block_hashes"),
        (batch(stored([H1], "p", [1, 2, 3, 4])), "malformed", "parent_block_hash"),
        (batch(stored([H1], None, [1, 2, 3, "4"])), "malformed", "token_ids"),
        (batch(stored([H1], None, [1, 2, 3, 4], medium=5)), "malformed", "medium"),
        (batch(stored([b"x" * 65], None, [1, 2, 3, 4])), "oversized", "max_bin_len"),  # no hash is that long
        (batch({"type": "BlockRemoved", "block_hashes": [True], "medium": None}), "malformed", "block_hashes"),
    ],
)
def test_malformed_batches_name_a_reason(payload: bytes, reason: str, words: str) -> None:
    with pytest.raises(KVEventError) as e:
        decode_batch(payload)
    assert e.value.reason == reason
    assert words in str(e.value)


def test_oversized_batches_are_refused_before_they_cost_memory() -> None:
    limits = DecodeLimits(max_payload_bytes=1000, max_events=3, max_blocks_per_event=2, max_tokens_per_event=9)
    with pytest.raises(KVEventError, match="oversized: payload of"):
        decode_batch(b"\x90" * 1001, limits)
    with pytest.raises(KVEventError, match="oversized: 4 events"):
        decode_batch(batch(*[{"type": "AllBlocksCleared"}] * 4), limits)
    with pytest.raises(KVEventError, match="oversized: event 0: 3 block hashes"):
        decode_batch(batch(stored([H1, H2, H3], None, list(range(9)), block_size=3)), limits)
    with pytest.raises(KVEventError, match=r"oversized: .*10 exceeds max_array_len"):
        decode_batch(batch(stored([H1, H2], None, list(range(10)), block_size=5)), limits)
    # An array longer than every bound is refused by the msgpack reader itself, before it is built.
    with pytest.raises(KVEventError, match="oversized: not a msgpack value within bounds"):
        decode_batch(msgpack.packb([1.0, [0] * 300_000]))


def test_frames() -> None:
    assert decode_frames([b"", (7).to_bytes(8, "big"), b"x"]) == (7, b"x")
    with pytest.raises(KVEventError, match="framing: expected 3 frames"):
        decode_frames([b"", b"x"])
    with pytest.raises(KVEventError, match="framing: sequence frame must be 8 bytes"):
        decode_frames([b"", b"\x01", b"x"])


def test_sequence_gaps_restarts_and_repeats() -> None:
    check = SequenceCheck()
    assert [check.check(s) for s in (5, 6, 6, 7, 10, 11, 0, 1, -1)] == [
        "first",
        "ok",
        "duplicate",
        "ok",
        "gap",
        "ok",
        "restart",
        "ok",
        "duplicate",
    ]


def test_view_rehashes_tokens_whatever_the_engine_hash() -> None:
    view = CacheView(max_blocks=100)
    tokens = list(range(1, 13))
    # Engine hashes are opaque: ints here, bytes there; the view finds blocks by the tokens.
    view.apply(EventBatch(0.0, (BlockStored((101, 102), None, tuple(tokens[:8]), 4),)))
    view.apply(EventBatch(0.0, (BlockStored((b"third",), 102, tuple(tokens[8:]), 4),)))
    mine = token_block_hashes(tokens, 4)
    assert view.matched_blocks(mine) == 3
    assert view.matched_blocks(token_block_hashes([1, 2, 3, 4, 5, 6, 7, 0, 9], 4)) == 1
    result = view.apply(EventBatch(0.0, (BlockRemoved((102,)),)))
    assert result.removed == 1
    assert view.matched_blocks(mine) == 1  # the third is still held, but not findable past the hole
    assert view.holds(mine[2])
    view.apply(EventBatch(0.0, (AllBlocksCleared(),)))
    assert (view.matched_blocks(mine), len(view), view.complete) == (0, 0, True)


def test_view_skips_what_tokens_alone_cannot_find() -> None:
    view = CacheView(max_blocks=100)
    result = view.apply(
        EventBatch(
            0.0,
            (
                BlockStored((1,), 999, (1, 2, 3, 4), 4),  # its parent was stored before we listened
                BlockStored((2,), None, (1, 2, 3, 4), 4, medium="CPU"),
                BlockStored((3,), None, (1, 2, 3, 4), 4, lora_name="adapter"),
                BlockStored((4,), None, (1, 2, 3, 4), 4, has_extra_keys=True),
                BlockStored((5,), None, (1, 2, 3, 4), 4, group_idx=1),
                BlockStored((6,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8),  # block size now 8: the first said 4
            ),
        )
    )
    assert result.skipped == {"unknown-parent": 1, "other-tier": 2, "extra-keys": 2, "block-size": 1}
    assert len(view) == 0
    view.apply(EventBatch(0.0, (BlockStored((7,), None, (1, 2, 3, 4), 4),)))
    result = view.apply(EventBatch(0.0, (BlockStored((6,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8),)))
    assert result.skipped == {"block-size": 1}


def test_view_is_bounded_against_floods_and_repeats() -> None:
    view = CacheView(max_blocks=10)
    view.complete = True
    flood = tuple(BlockStored((i,), None, (i, i, i, i), 4) for i in range(25))
    result = view.apply(EventBatch(0.0, flood))
    assert (len(view), result.skipped, view.complete) == (10, {"overflow": 15}, False)
    assert view.matched_blocks(token_block_hashes([24] * 4, 4)) == 1  # the newest are kept
    assert view.matched_blocks(token_block_hashes([0] * 4, 4)) == 0
    # The same engine block stored twice is one block, and one removal removes it.
    view.clear(complete=True)
    twice = BlockStored((1,), None, (5, 5, 5, 5), 4)
    view.apply(EventBatch(0.0, (twice, twice)))
    view.apply(EventBatch(0.0, (BlockRemoved((1,)),)))
    assert (len(view), view.matched_blocks(token_block_hashes([5] * 4, 4))) == (0, 0)


def test_a_reported_hit_refreshes_the_chain_it_names() -> None:
    """vLLM's "full" report mode announces a request's cached prefix again from the root: the view keeps
    one copy of each block, refreshes its age (so the overflow drops the others first) and learns the
    part it had not seen (a chain whose start was stored before the router subscribed)."""
    prompt = list(range(1, 17))  # 4 blocks of 4
    view = CacheView(max_blocks=6)
    # Joined late: the view saw blocks 2-3 stored under a parent it lacks (skipped), and two others.
    view.apply(EventBatch(0.0, (BlockStored((12, 13), 11, tuple(prompt[8:]), 4),)))
    view.apply(EventBatch(0.0, (BlockStored((50, 51), None, (7,) * 8, 4),)))
    assert view.matched_blocks(token_block_hashes(prompt, 4)) == 0
    hit = BlockStored((10, 11, 12, 13), None, tuple(prompt), 4)
    view.apply(EventBatch(0.0, (hit,)))
    assert (len(view), view.matched_blocks(token_block_hashes(prompt, 4))) == (6, 4)
    view.apply(EventBatch(0.0, (hit,)))  # reported again: still one copy of each
    assert len(view) == 6
    view.apply(EventBatch(0.0, (BlockStored((50, 51), None, (7,) * 8, 4), hit)))  # the prompt is the newest
    view.apply(EventBatch(0.0, (BlockStored((60, 61), None, (9,) * 8, 4),)))  # overflow: the oldest two go
    assert view.matched_blocks(token_block_hashes(prompt, 4)) == 4
    assert view.matched_blocks(token_block_hashes([7] * 8, 4)) == 0
    view.apply(EventBatch(0.0, (BlockRemoved((10, 11, 12, 13)),)))
    assert view.matched_blocks(token_block_hashes(prompt, 4)) == 0
