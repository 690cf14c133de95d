"""The KV-cache events as the router holds them once decoded, and the error a bad batch raises.

Shared by the decoder that builds them and the cache view that applies them (and by tests that build
batches by hand), so neither has to import the other.
"""

from __future__ import annotations

from dataclasses import dataclass


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
