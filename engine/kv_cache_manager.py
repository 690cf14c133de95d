"""The KV-cache manager: the one layer between the scheduler and the block pool (vLLM v1's
``KVCacheManager``). The scheduler asks it in tokens and sequences -- which prefix is cached, can
these tokens get slots, free this sequence -- and it turns that into block ids, hashes and
reference counts. Only this module writes a sequence's ``block_table``, ``block_hashes`` and
``num_registered_blocks``; the pool itself is edited nowhere else.

Also here: how many blocks the pool gets (``pool_size_blocks``), a pure function of the settings.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from kvfleet.engine.block_pool import BlockPool, blocks_for_tokens, chain_block_hashes
from kvfleet.engine.kv_events import block_stored
from kvfleet.engine.sequence import Sequence


def pool_size_blocks(
    *,
    num_kv_blocks: int,
    kv_cache_memory_bytes: int,
    kv_bytes_per_token: int,
    block_size_tokens: int,
    max_num_seqs: int,
    max_model_len_tokens: int,
) -> int:
    """``num_kv_blocks`` when set; otherwise the memory budget, but no more than every running
    sequence at full context could use (a tiny model must not reserve 512 MiB)."""
    if num_kv_blocks:
        return num_kv_blocks
    by_memory = kv_cache_memory_bytes // (kv_bytes_per_token * block_size_tokens)
    by_use = max_num_seqs * blocks_for_tokens(max_model_len_tokens, block_size_tokens)
    return max(1, min(by_memory, by_use))


class KVCacheManager:
    """A sequence's KV blocks: prefix lookup at admission, slots for each step's tokens, the prefix
    cache filled as blocks are computed, and everything released when it finishes or is preempted."""

    def __init__(self, pool: BlockPool, block_size_tokens: int, hash_seed: bytes) -> None:
        self.pool = pool
        self.block_size_tokens = block_size_tokens
        # The first block's parent hash: the model's root, so no two models share a block.
        self.hash_seed = hash_seed

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (vLLM's ``kv_cache_usage_perc``)."""
        return self.pool.usage()

    def take_events(self) -> list[dict[str, Any]]:
        """The pool's KV-cache events since the last call, oldest first (empty when not recorded)."""
        events = self.pool.events
        if not events:
            return []
        taken = events[:]
        events.clear()
        return taken

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks of the longest prefix of a waiting sequence; changes nothing in the pool.

        The last token is always left to compute: its logits give the first new token."""
        self._update_hashes(seq)
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size_tokens
        return self.pool.match_prefix(seq.block_hashes[:max_hit_blocks])

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] | None = None) -> int:
        """Free blocks that ``num_new_tokens`` more slots would take. ``computed_blocks``: admission,
        the sequence's table will start with these cached blocks (those sitting in the free list
        count too: sharing takes them out of it)."""
        bs = self.block_size_tokens
        if computed_blocks is not None:
            new = blocks_for_tokens(len(computed_blocks) * bs + num_new_tokens, bs) - len(computed_blocks)
            return new + self.pool.free_needed_to_share(computed_blocks)
        return max(0, blocks_for_tokens(seq.num_computed_tokens + num_new_tokens, bs) - len(seq.block_table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] | None = None) -> bool:
        """Give the sequence slots for ``num_new_tokens`` past its computed tokens. ``computed_blocks``:
        admission, its table becomes those shared cached blocks plus new ones. False, changing
        nothing, when the pool has too few free blocks (``blocks_needed`` says how many it wanted)."""
        bs, pool = self.block_size_tokens, self.pool
        if computed_blocks is None:  # every running sequence, every step: the short path
            need = blocks_for_tokens(seq.num_computed_tokens + num_new_tokens, bs) - len(seq.block_table)
            if need <= 0:
                return True
            if need > pool.num_free:
                return False
            seq.block_table.extend(pool.allocate(need))
            return True
        new = blocks_for_tokens(len(computed_blocks) * bs + num_new_tokens, bs) - len(computed_blocks)
        if new + pool.free_needed_to_share(computed_blocks) > pool.num_free:
            return False
        pool.share(computed_blocks)
        seq.block_table = [*computed_blocks, *pool.allocate(new)]
        seq.num_registered_blocks = len(computed_blocks)
        if computed_blocks and seq.params.kv_cache_report_mode == "full" and pool.events is not None:
            # vLLM's "full" report mode: the hit blocks again, as one BlockStored from the prompt's start.
            n = len(computed_blocks)
            pool.events.append(block_stored(seq.block_hashes[:n], None, seq.token_ids[: n * bs], bs))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly full, computed blocks findable in the prefix cache."""
        bs = self.block_size_tokens
        # A block whose last token is still a placeholder (its id on the device) waits a step.
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // bs
        if full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq)
        hashes = seq.block_hashes
        for b in range(seq.num_registered_blocks, full):
            parent = hashes[b - 1] if b else None
            self.pool.register(seq.block_table[b], hashes[b], parent, seq.token_ids[b * bs : (b + 1) * bs])
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (they stay findable by hash until their memory is needed)."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _update_hashes(self, seq: Sequence) -> None:
        bs = self.block_size_tokens
        known = len(seq.block_hashes)
        num_known = seq.num_known_tokens  # placeholders are never hashed
        if num_known // bs > known:
            parent = seq.block_hashes[-1] if seq.block_hashes else self.hash_seed
            seq.block_hashes.extend(chain_block_hashes(parent, seq.token_ids[known * bs : num_known], bs))
