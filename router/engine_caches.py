"""What a model's replicas hold in their KV caches, by their own events, and how the prefix scorer reads it.

Each replica with an event subscription has a ``ReplicaEvents``: its ``CacheView`` (kv_events/cache_view.py) and
whether the view can be used now. A view is used only while its subscription is connected and has
received a batch since (re)connecting, so a dead or silent publisher never steers requests; a
replica without events, or whose view is not usable, is scored by the router's learned index, as
before. Where a view is usable:
- ``complete`` (every batch since the engine's cache was empty was applied): the view is the truth,
  a block it lacks is not held, even where the learned index guesses it is;
- otherwise (subscribed mid-stream, batches lost): what it holds is held, and the learned index may
  add what it does not know: the larger of the two.

The prefix scorer counts the router's own text blocks (``prompt.block_hashes``); engines count token
blocks. A replica holding ``m`` of the prompt's ``t`` token blocks is credited ``m / t`` of the
prompt's text blocks, so scores of replicas with and without events stay in one unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet.router.kv_events import ApplyResult, CacheView, EventBatch, SequenceCheck


@dataclass
class ReplicaEvents:
    view: CacheView
    seq: SequenceCheck = field(default_factory=SequenceCheck)
    connected: bool = False
    synced: bool = False  # a batch arrived since the subscription (re)connected
    _reconnected: bool = False

    @property
    def usable(self) -> bool:
        return self.connected and self.synced and self.view.block_size is not None

    def on_connected(self) -> None:
        self._reconnected = self.seq.next is not None
        self.connected = True
        self.synced = False

    def on_disconnected(self) -> None:
        self.connected = False
        self.synced = False

    def on_batch(self, seq: int, batch: EventBatch) -> tuple[str, ApplyResult | None]:
        """Apply one batch; returns what its sequence number meant (``kv_events.SequenceCheck``) and the result.

        A publisher's first batch is number 0: a view that starts from it is complete. A view that
        starts later cannot know what was stored before. After a reconnection the view starts over
        whatever the number: the engine may be a new process whose numbering, started again from 0,
        has reached the number expected from the old one (vLLM's batches carry no process identity),
        and a PUB socket drops what it sends while a subscriber is away anyway.
        """
        kind = self.seq.check(seq)
        if kind == "duplicate" and not self._reconnected:
            return kind, None
        resumed = self._reconnected
        self._reconnected = False
        if kind in ("first", "restart") or resumed:
            self.view.clear(complete=seq == 0)
            if resumed and kind != "restart":
                kind = "resync"
        elif kind == "gap":
            self.view.complete = False
        self.synced = True
        return kind, self.view.apply(batch)


class EngineCaches:
    """One model's replicas' event views."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        self.max_blocks_per_replica = max_blocks_per_replica
        self._replicas: dict[str, ReplicaEvents] = {}

    def add(self, replica_id: str) -> ReplicaEvents:
        state = ReplicaEvents(CacheView(self.max_blocks_per_replica))
        self._replicas[replica_id] = state
        return state

    def remove(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def get(self, replica_id: str) -> ReplicaEvents | None:
        return self._replicas.get(replica_id)

    def replica_ids(self) -> list[str]:
        return list(self._replicas)

    def block_size(self) -> int | None:
        """The token block size of the usable views (the first one's; views of another size are not used)."""
        for state in self._replicas.values():
            if state.usable:
                return state.view.block_size
        return None

    def usable_count(self) -> int:
        return sum(1 for s in self._replicas.values() if s.usable)

    def blocks(self) -> int:
        return sum(len(s.view) for s in self._replicas.values())

    def matched(self, replica_id: str, tokens: Sequence[int], block_size: int, text_blocks: int, learned: int) -> float:
        """The replica's credit in text blocks: its events' where usable, else ``learned`` (the index's)."""
        state = self._replicas.get(replica_id)
        if state is None or not state.usable or state.view.block_size != block_size or not tokens:
            return float(learned)
        held = state.view.matched_blocks(tokens) * text_blocks / len(tokens)
        return held if state.view.complete else max(held, float(learned))

    def held_anywhere(self, token_hash: int) -> bool:
        for state in self._replicas.values():  # noqa: SIM110 (no generator on the routing path)
            if state.usable and state.view.holds(token_hash):
                return True
        return False
