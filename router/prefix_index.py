"""Which prompt blocks each replica probably holds in its KV cache: one bounded LRU of block hashes per replica.

The index only learns after a pick (``record``); scoring (``matched_blocks``) is read-only, so asking
about a replica never changes what the index believes. Each replica's LRU is bounded by an estimate
of its KV capacity, and a replica that leaves is forgotten, so memory is bounded by
``replicas x capacity`` however many distinct prompts pass through.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    """Per-replica LRU sets of chained block hashes (see ``kvfleet.router.prompt.block_hashes``)."""

    def __init__(self, default_capacity_blocks: int) -> None:
        if default_capacity_blocks < 1:
            raise ValueError(f"default_capacity_blocks must be >= 1, got {default_capacity_blocks}")
        self._default_capacity = default_capacity_blocks
        self._capacity: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def set_capacity(self, replica_id: str, capacity_blocks: int | None) -> None:
        """Bound one replica's LRU by its own KV capacity estimate (None: the default)."""
        if capacity_blocks is None:
            self._capacity.pop(replica_id, None)
        else:
            if capacity_blocks < 1:
                raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
            self._capacity[replica_id] = capacity_blocks
        lru = self._lru.get(replica_id)
        if lru is not None:
            self._evict(replica_id, lru)

    def capacity(self, replica_id: str) -> int:
        return self._capacity.get(replica_id, self._default_capacity)

    def matched_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica holds (read-only).

        A binary search, not a scan: what a replica holds is prefix-closed along every chain, because
        ``record`` touches a block's parent right after the block itself and eviction takes the least
        recent first, so a parent never leaves before its child. A 125-block prompt takes ~7 lookups
        per replica instead of up to 125.
        """
        lru = self._lru.get(replica_id)
        if not lru or not hashes or hashes[0] not in lru:
            return 0
        high = len(hashes)
        if hashes[high - 1] in lru:
            return high
        low = 1  # hashes[:low] held, hashes[high - 1] not
        high -= 1
        while low < high:
            mid = (low + high) // 2
            if hashes[mid] in lru:
                low = mid + 1
            else:
                high = mid
        return low

    def held_anywhere(self, block_hash: int) -> bool:
        """Whether any replica is believed to hold this block (read-only; one lookup per replica)."""
        for lru in self._lru.values():  # noqa: SIM110 (a loop, not any(...): no generator on the routing path)
            if block_hash in lru:
                return True
        return False

    def record(self, replica_id: str, hashes: Sequence[int]) -> None:
        """The prompt was sent to the replica: its blocks are now the most recently used there."""
        if not hashes:
            return
        lru = self._lru.get(replica_id)
        if lru is None:
            lru = self._lru[replica_id] = OrderedDict()
        # Last block first, so the first (most shared) block ends most recent and tails are evicted first,
        # the order an engine's prefix cache frees blocks in.
        move_to_end = lru.move_to_end
        for h in reversed(hashes):
            if h in lru:  # one lookup for a held block (the common case), not a store and a move
                move_to_end(h)
            else:
                lru[h] = None
        self._evict(replica_id, lru)

    def forget(self, replica_id: str) -> None:
        """The replica left: drop everything known about it."""
        self._lru.pop(replica_id, None)
        self._capacity.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in ``replica_ids``."""
        keep = set(replica_ids)
        for replica_id in [r for r in self._lru if r not in keep]:
            self.forget(replica_id)
        for replica_id in [r for r in self._capacity if r not in keep]:
            self._capacity.pop(replica_id, None)

    def entries(self, replica_id: str | None = None) -> int:
        """Block hashes held (for one replica, or in total)."""
        if replica_id is not None:
            return len(self._lru.get(replica_id, ()))
        return sum(len(lru) for lru in self._lru.values())

    def replicas(self) -> list[str]:
        return sorted(self._lru)

    def _evict(self, replica_id: str, lru: OrderedDict[int, None]) -> None:
        capacity = self.capacity(replica_id)
        while len(lru) > capacity:
            lru.popitem(last=False)
