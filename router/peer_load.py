"""The other routers' in-flight and waiting counts per replica, as they report them: the fleet-wide load.

Several routers behind one Service each see only their own requests. Where nothing is cached, load
is the only signal, and a third of it is not enough: each router's shortest queue is often another
router's just-filled one (bench/routing_sim.py --routers 3, "nothing shared": TTFT mean 56 -> 74 ms).
Each router adds what its peers report to its own counts, so it picks on the whole fleet's load.

Measured, freshness is what matters (docs/router.md, "Several routers"): the engines' own counts read
every 0.25 s, even corrected by this router's sends since, send bursts to the same stale minimum;
peers' counts pushed on every change and seen ~1 ms later route as one router does. So a report is
a peer's absolute counts for the replicas that changed (idempotent: a lost report is corrected by
the next one), numbered per peer process so a late one never undoes a newer one.

Degrades to the router's own counts: a peer not heard for ``max_age_s`` is left out, and with no
peer heard at all ``add_to`` returns the candidates it was given. Bounded: ``max_peers`` peers (a
new one past that is refused until one ages out), ``max_replicas`` replicas per peer, counts clamped
to ``max_count``. Nothing here does I/O or reads a clock: the transport passes reports and times in.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet.router.picking import Candidate


@dataclass
class _Peer:
    seq: int
    heard_s: float
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # replica -> (in flight, waiting)


@dataclass
class PeerLoads:
    """One model's replicas' load as the other router processes last reported it."""

    max_age_s: float = 1.0
    max_peers: int = 64
    max_replicas: int = 4096
    max_count: int = 100_000
    _peers: dict[str, _Peer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {self.max_age_s}")
        for name in ("max_peers", "max_replicas", "max_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def apply(
        self,
        peer_id: str,
        seq: int,
        counts: Iterable[tuple[str, int, int]],
        now_s: float,
        full: bool = False,
        known: Container[str] | None = None,
    ) -> str:
        """Take one report: ``counts`` is (replica id, in flight, waiting) for the replicas that changed;
        ``full``: for every replica the peer has, so a replica it no longer reports is dropped;
        ``known``: the replicas this router routes to (others are left out; None: all kept).

        Returns what it did: ``applied``; ``stale`` (a number at or below the last one applied from
        this peer: reordered or repeated); ``refused`` (``max_peers`` others are live; nothing kept).
        ``peer_id`` names a process: a restarted peer reports under a new id, and the old one ages out.
        """
        peer = self._peers.get(peer_id)
        if peer is None:
            if len(self._peers) >= self.max_peers:
                self.expire(now_s)
                if len(self._peers) >= self.max_peers:
                    return "refused"
            peer = self._peers[peer_id] = _Peer(seq - 1, now_s)
        elif seq <= peer.seq:
            return "stale"
        peer.seq = seq
        peer.heard_s = now_s
        if full:
            peer.counts.clear()
        top = self.max_count
        for replica_id, inflight, waiting in counts:
            if known is not None and replica_id not in known:
                continue
            if replica_id not in peer.counts and len(peer.counts) >= self.max_replicas:
                continue  # bounded: a peer cannot grow this past max_replicas entries
            peer.counts[replica_id] = (min(max(inflight, 0), top), min(max(waiting, 0), top))
        return "applied"

    def expire(self, now_s: float) -> None:
        """Forget peers not heard for ``max_age_s`` (a stopped or partitioned router counts for nothing)."""
        old = [p for p, peer in self._peers.items() if now_s - peer.heard_s > self.max_age_s]
        for peer_id in old:
            del self._peers[peer_id]

    def forget_replica(self, replica_id: str) -> None:
        for peer in self._peers.values():
            peer.counts.pop(replica_id, None)

    def live_peers(self, now_s: float) -> int:
        return sum(1 for peer in self._peers.values() if now_s - peer.heard_s <= self.max_age_s)

    def add_to(self, candidates: Sequence[Candidate], now_s: float) -> Sequence[Candidate]:
        """The candidates with the live peers' counts added to this router's own (unchanged when none is live)."""
        live = [peer.counts for peer in self._peers.values() if now_s - peer.heard_s <= self.max_age_s]
        if not live:
            return candidates
        out = []
        for c in candidates:  # per routed request: plain loops and the tuple's own constructor (no _replace)
            replica_id, inflight, draining, ejected, waiting = c
            for counts in live:
                found = counts.get(replica_id)
                if found is not None:
                    inflight += found[0]
                    waiting += found[1]
            out.append(type(c)(replica_id, inflight, draining, ejected, waiting))
        return out
