"""Engine KV-cache events in vLLM's format, decoded and applied to a bounded view of each replica's cache.

The wire format is vLLM's (``vllm/distributed/kv_events.py``, ``--kv-events-config``): a ZeroMQ PUB
socket sends three frames per batch, ``(topic, sequence, payload)``; ``sequence`` is an 8-byte
big-endian counter that starts at 0 when the publisher starts; ``payload`` is msgspec's msgpack of
``KVEventBatch``, an array ``[ts, events, data_parallel_rank]`` (the rank may be left off). Each
event is a tagged struct. vLLM encodes it as a map with its class name under ``"type"``::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": n, "lora_id": ..., "medium": "GPU", "lora_name": ..., ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Older vLLM releases declared the events ``array_like``: ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name?]``; both forms are read.
Block hashes are bytes (sha256 by default) or 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

The router never reproduces the engine's hash function: a ``BlockStored`` carries each block's token
ids and its parent's hash, so the view re-hashes the tokens with the router's own chained hash
(``token_block_hashes``), keyed by the parent's router hash, and maps each engine hash to it for the
``BlockRemoved`` that names only engine hashes. Whatever algorithm and seed the engine uses
(``prefix_caching_hash_algo``, ``PYTHONHASHSEED``), a request's tokens hashed by the router find the
blocks the engine holds for them. What must match is the tokenization and the block size.

Nothing here does I/O: ``decode_batch`` turns bytes into events or raises ``KVEventError`` with a
reason; ``SequenceCheck`` says what a sequence number means; ``CacheView`` applies events with a
bound on the blocks it keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

# Python's hash() never returns -1, so it cannot collide with a block's router hash.
ROOT_HASH = -1

MAX_HASH_BYTES = 64  # sha256 is 32; anything longer is not a block hash


class KVEventError(ValueError):
    """A batch that cannot be applied; ``reason`` is the metric label (a short, fixed word)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes | int, ...]
    parent_block_hash: bytes | int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # True when any block's hash has extra keys (multimodal inputs, a cache salt, a LoRA): its tokens
    # alone do not say which request could hit it.
    has_extra_keys: bool = False
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes | int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds on one batch, so a broken or hostile publisher costs bounded memory and CPU."""

    max_payload_bytes: int = 4 * 1024 * 1024
    max_events: int = 4096
    max_blocks_per_event: int = 4096
    max_tokens_per_event: int = 4096 * 64


def decode_frames(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(topic, sequence, payload)`` -> ``(sequence, payload)``."""
    if len(frames) != 3:
        raise KVEventError("framing", f"expected 3 frames (topic, sequence, payload), got {len(frames)}")
    _, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise KVEventError("framing", f"sequence frame must be 8 bytes, got {len(seq_bytes)}")
    return int.from_bytes(seq_bytes, "big", signed=True), payload


def decode_batch(payload: bytes, limits: DecodeLimits = DecodeLimits()) -> EventBatch:
    """One ``KVEventBatch`` payload, validated field by field."""
    if len(payload) > limits.max_payload_bytes:
        raise KVEventError("oversized", f"payload of {len(payload)} bytes > {limits.max_payload_bytes}")
    cap = max(limits.max_events, limits.max_blocks_per_event, limits.max_tokens_per_event)
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_array_len=cap,
            max_map_len=64,
            max_str_len=1024,
            max_bin_len=MAX_HASH_BYTES,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        reason = "oversized" if "exceeds max_" in str(e) else "malformed"
        raise KVEventError(reason, f"not a msgpack value within bounds: {e}") from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise KVEventError("malformed", "a batch is an array [ts, events, data_parallel_rank?]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventError("malformed", "batch ts must be a number")
    if not isinstance(events, list):
        raise KVEventError("malformed", "batch events must be an array")
    if len(events) > limits.max_events:
        raise KVEventError("oversized", f"{len(events)} events in one batch > {limits.max_events}")
    if rank is not None and not _is_int(rank):
        raise KVEventError("malformed", "data_parallel_rank must be an integer or nil")
    return EventBatch(float(ts), tuple(_event(e, i, limits) for i, e in enumerate(events)), rank)


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _event(raw: Any, i: int, limits: DecodeLimits) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:  # array_like events: the tag, then the fields in declaration order
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KVEventError("malformed", f"event {i} is neither a tagged map nor a tagged array")
    if tag == "BlockStored":
        return _stored(fields, i, limits)
    if tag == "BlockRemoved":
        return BlockRemoved(
            _hashes(fields.get("block_hashes"), i, limits), _opt_str(fields, "medium", i), _group(fields, i)
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventError("unknown-event", f"event {i} has type {tag!r}")


def _stored(fields: dict[str, Any], i: int, limits: DecodeLimits) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"), i, limits)
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise KVEventError("malformed", f"event {i}: parent_block_hash must be bytes, an integer or nil")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise KVEventError("malformed", f"event {i}: token_ids must be an array of integers")
    if len(tokens) > limits.max_tokens_per_event:
        raise KVEventError("oversized", f"event {i}: {len(tokens)} token ids > {limits.max_tokens_per_event}")
    block_size: Any = fields.get("block_size")
    if not _is_int(block_size) or block_size < 1:
        raise KVEventError("malformed", f"event {i}: block_size must be a positive integer")
    if len(tokens) != len(hashes) * block_size:
        raise KVEventError(
            "malformed", f"event {i}: {len(tokens)} token ids for {len(hashes)} blocks of {block_size} tokens"
        )
    lora_id = fields.get("lora_id")
    if lora_id is not None and not _is_int(lora_id):
        raise KVEventError("malformed", f"event {i}: lora_id must be an integer or nil")
    extra: Any = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise KVEventError("malformed", f"event {i}: extra_keys must be an array or nil")
    return BlockStored(
        hashes,
        parent,
        tuple(tokens),
        block_size,
        lora_id,
        _opt_str(fields, "medium", i),
        _opt_str(fields, "lora_name", i),
        extra is not None and any(extra),
        _group(fields, i),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: Any) -> bool:
    return (isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES) or _is_int(value)


def _hashes(value: Any, i: int, limits: DecodeLimits) -> tuple[bytes | int, ...]:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        raise KVEventError("malformed", f"event {i}: block_hashes must be an array of bytes or integers")
    if len(value) > limits.max_blocks_per_event:
        raise KVEventError("oversized", f"event {i}: {len(value)} block hashes > {limits.max_blocks_per_event}")
    return tuple(value)


def _opt_str(fields: dict[str, Any], name: str, i: int) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise KVEventError("malformed", f"event {i}: {name} must be a string or nil")
    return value


def _group(fields: dict[str, Any], i: int) -> int | None:
    value = fields.get("group_idx")
    if value is not None and not _is_int(value):
        raise KVEventError("malformed", f"event {i}: group_idx must be an integer or nil")
    return value


# -- sequence numbers ------------------------------------------------------------------------------


@dataclass
class SequenceCheck:
    """What each batch's sequence number says about the batches before it.

    ``next``: the number expected (None before the first batch). A publisher numbers its batches from
    0 when it starts, so a number below the expected one is a restarted engine (its cache is empty),
    unless it is a repeat of one just seen.
    """

    next: int | None = None

    def check(self, seq: int) -> str:
        """``ok``, ``first`` (the first batch seen), ``gap`` (batches were lost: a slow subscriber past the
        socket's high-water mark, a dropped connection), ``restart`` (the publisher started over) or
        ``duplicate`` (the batch just before again; skip it)."""
        expected = self.next
        if seq < 0:
            return "duplicate"  # vLLM's end-of-replay marker (-1) is never a batch
        if expected is None:
            self.next = seq + 1
            return "first"
        if seq == expected:
            self.next = seq + 1
            return "ok"
        if seq == expected - 1:
            return "duplicate"
        self.next = seq + 1
        return "gap" if seq > expected else "restart"


# -- the cache view -------------------------------------------------------------------------------


def token_block_hashes(token_ids: Sequence[int], block_size: int, *, max_blocks: int | None = None) -> list[int]:
    """The router's chained hashes of the whole ``block_size``-token blocks of ``token_ids``.

    Python's keyed hash (process-local, like ``prompt.block_hashes``): the view and the requests of
    one router process compare them, nothing else does.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    previous = ROOT_HASH
    for start in range(0, n * block_size, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        out.append(previous)
    return out


@dataclass
class ApplyResult:
    stored: int = 0
    removed: int = 0
    cleared: bool = False
    skipped: dict[str, int] | None = None  # blocks not taken, by reason

    def skip(self, reason: str, blocks: int) -> None:
        if self.skipped is None:
            self.skipped = {}
        self.skipped[reason] = self.skipped.get(reason, 0) + blocks


class CacheView:
    """One replica's KV-cache contents as its events say: engine hash -> router hash, bounded.

    ``max_blocks`` bounds memory whatever the replica sends (an engine has at most its pool's blocks
    cached; more means missed removals or a flood): past it the oldest stored blocks are dropped, and
    counted. Blocks in another medium (``CPU``, ``STORAGE`` offload tiers) or another KV-cache group
    are not the GPU prefix cache a request hits, and blocks with extra keys (LoRA, multimodal, cache
    salt) are not found by tokens alone: those are skipped, and so is a block whose parent the view
    does not hold (stored before the router subscribed): its router hash cannot be chained.

    ``complete``: the view has seen every batch since the engine's cache was empty (the publisher's
    first batch, or an ``AllBlocksCleared``), so a block it lacks is one the engine lacks. A view
    that joined late or lost batches is still true where it says a block is held, not where it says
    one is missing.
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self.complete = False
        self._router_of: dict[bytes | int, int] = {}  # engine hash -> router hash, oldest first
        self._held: dict[int, int] = {}  # router hash -> engine blocks with it

    def __len__(self) -> int:
        return len(self._router_of)

    def clear(self, *, complete: bool) -> None:
        self._router_of.clear()
        self._held.clear()
        self.complete = complete

    def apply(self, batch: EventBatch) -> ApplyResult:
        result = ApplyResult()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event, result)
            elif isinstance(event, BlockRemoved):
                self._remove(event, result)
            else:
                self.clear(complete=True)
                result.cleared = True
        overflow = len(self._router_of) - self.max_blocks
        if overflow > 0:
            router_of = self._router_of
            for engine_hash in list(router_of)[:overflow]:
                self._drop(router_of.pop(engine_hash))
            self.complete = False  # what was dropped may still be held
            result.skip("overflow", overflow)
        return result

    def _store(self, event: BlockStored, result: ApplyResult) -> None:
        n = len(event.block_hashes)
        if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
            result.skip("other-tier", n)
            return
        if event.has_extra_keys or event.lora_id is not None or event.lora_name is not None:
            result.skip("extra-keys", n)
            return
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            result.skip("block-size", n)
            return
        if event.parent_block_hash is None:
            previous = ROOT_HASH
        else:
            found = self._router_of.get(event.parent_block_hash)
            if found is None:
                result.skip("unknown-parent", n)
                return
            previous = found
        bs = event.block_size
        tokens = event.token_ids
        router_of = self._router_of
        held = self._held
        for j, engine_hash in enumerate(event.block_hashes):
            previous = hash((previous, tokens[j * bs : (j + 1) * bs]))
            old = router_of.pop(engine_hash, None)  # stored again: refresh its age, no double count
            if old is not None:
                self._drop(old)
            router_of[engine_hash] = previous
            held[previous] = held.get(previous, 0) + 1
        result.stored += n

    def _remove(self, event: BlockRemoved, result: ApplyResult) -> None:
        if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
            return
        for engine_hash in event.block_hashes:
            router_hash = self._router_of.pop(engine_hash, None)
            if router_hash is not None:
                self._drop(router_hash)
                result.removed += 1

    def _drop(self, router_hash: int) -> None:
        left = self._held[router_hash] - 1
        if left:
            self._held[router_hash] = left
        else:
            del self._held[router_hash]

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt's ``token_block_hashes`` the engine holds (read-only).

        A scan, not a binary search: an engine's cache is not prefix-closed (it frees a finished
        sequence's blocks tail first, but blocks shared by several sequences leave in any order).
        """
        held = self._held
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def holds(self, router_hash: int) -> bool:
        return router_hash in self._held
