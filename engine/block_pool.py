"""The KV block pool's bookkeeping: ref-counted blocks, the prefix-cache hash map and the LRU of
free blocks. Pure Python, no tensors: the pool's memory lives in the model runner, indexed by the
block ids handed out here.

A full block's hash chains its parent's hash and its token ids, seeded by the model id, so equal
prefixes of the same model map to the same blocks and nothing else does. A block whose last user
finished keeps its hash and stays findable until the memory is needed for a new block (LRU).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.engine.kv_events import block_removed, block_stored


def root_hash(model_id: str) -> bytes:
    return hashlib.sha256(b"kvfleet-prefix:" + model_id.encode()).digest()


def chain_block_hashes(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, each chaining the previous one from ``parent``."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start : start + block_size]).tobytes()).digest()
        hashes.append(parent)
    return hashes


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPoolExhaustedError(RuntimeError):
    """Asked for more free blocks than exist; callers check ``num_free`` first, so this is a bug."""


class BlockPool:
    """``record_events``: keep a ``BlockStored`` per block made findable and a ``BlockRemoved`` per cached
    block evicted, in order, in ``events`` (the engine sends and empties it after each step)."""

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody references, oldest first: allocation takes (and evicts) from the front.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self.events: list[dict[str, Any]] | None = [] if record_events and enable_prefix_caching else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``; changes nothing."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def free_needed_to_share(self, block_ids: Sequence[int]) -> int:
        """How many of these cached blocks sit in the free list (sharing them uses free capacity)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def share(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise BlockPoolExhaustedError(f"asked for {count} blocks with {len(self._free)} free")
        out: list[int] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                # Evicting a cached block: it must no longer be found by its hash.
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                    if self.events is not None:
                        self.events.append(block_removed([block.block_hash]))
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Tail blocks are released first so that, among a
        sequence's blocks, the tail (least likely shared) is evicted first."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Nothing to find it by: reuse it before any cached block.
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)
                else:
                    self._free[b] = None

    def register(
        self,
        block_id: int,
        block_hash: bytes,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Make a full, computed block findable by its hash (first writer wins on duplicates).

        ``parent_hash`` (None for a prompt's first block) and ``token_ids`` go into its event."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.append(block_stored([block_hash], parent_hash, list(token_ids), len(token_ids)))
