"""``CacheView``: one replica's KV-cache contents as its events say, bounded; and the router's block hash.

``token_block_hashes`` lives here because the view's chained hash of an event's tokens and a
request's hash of its prompt must be the same function: a request finds the blocks an engine holds
only when both hash alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.router.kv_events.events import BlockRemoved, BlockStored, EventBatch

# Python's hash() never returns -1, so it cannot collide with a block's router hash.
ROOT_HASH = -1


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, *, max_blocks: int | None = None, parent: int = ROOT_HASH
) -> list[int]:
    """The router's chained hashes of the whole ``block_size``-token blocks of ``token_ids``, chained
    from ``parent`` (the router hash of the block before the first; ``ROOT_HASH`` for a prompt's start).

    Python's keyed hash (process-local, like ``prompt.block_hashes``): the view and the requests of
    one router process compare them, nothing else does. The view hashes an event's blocks with the
    same step (``chain_hash``), so the two cannot drift apart.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    previous = parent
    for start in range(0, n * block_size, block_size):
        previous = chain_hash(previous, token_ids[start : start + block_size])
        out.append(previous)
    return out


def chain_hash(parent: int, block: Sequence[int]) -> int:
    """One block's router hash under its parent's: the one step of ``token_block_hashes``."""
    return hash((parent, tuple(block)))


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
        router_of = self._router_of
        held = self._held
        tokens = event.token_ids
        bs = event.block_size
        # decode_batch checked there are block_size tokens per block hash; an event built by hand with
        # fewer stores only its whole blocks.
        n = min(n, len(tokens) // bs)
        for i, engine_hash in enumerate(event.block_hashes[:n]):
            known = router_of.pop(engine_hash, None)
            if known is not None:
                # Stored again (a hit reported, a repeat): refresh its age, no double count, and no hashing of
                # its tokens. An engine hash names one chain, so its router hash is the one already held.
                router_of[engine_hash] = known
                previous = known
                continue
            previous = chain_hash(previous, tokens[i * bs : (i + 1) * bs])
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
