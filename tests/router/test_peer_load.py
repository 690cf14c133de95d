"""Peers' reported load: the bounded store (``PeerLoads``) and three real ``Fleet`` objects (three routers)
that report their counts to each other instead of each picking on its own third of the load."""

from __future__ import annotations

import pytest

from kvfleet.router.fleet import Fleet
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.peer_load import PeerLoads
from kvfleet.router.picking import Candidate
from kvfleet.router.replica_lease import ReplicaLease
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec

OWN = [Candidate("a", 2, waiting=1), Candidate("b", 0, waiting=0)]


def test_live_peers_counts_are_added_to_the_routers_own() -> None:
    peers = PeerLoads(max_age_s=1.0)
    assert peers.apply("p1", 1, [("a", 3, 1), ("b", 5, 2)], now_s=10.0) == "applied"
    assert peers.apply("p2", 7, [("b", 1, 1)], now_s=10.0) == "applied"
    out = peers.add_to(OWN, now_s=10.5)
    assert [(c.replica_id, c.inflight, c.waiting) for c in out] == [("a", 5, 2), ("b", 6, 3)]


def test_no_peer_heard_leaves_the_own_counts_as_they_are() -> None:
    peers = PeerLoads(max_age_s=1.0)
    assert peers.add_to(OWN, now_s=0.0) is OWN  # no peer ever: today's candidates, untouched
    peers.apply("p1", 1, [("b", 9, 9)], now_s=10.0)
    assert peers.add_to(OWN, now_s=11.5) is OWN  # heard 1.5 s ago: counts for nothing
    assert peers.live_peers(11.5) == 0


def test_a_late_or_repeated_report_never_undoes_a_newer_one() -> None:
    peers = PeerLoads()
    peers.apply("p1", 5, [("a", 4, 2)], now_s=1.0)
    assert peers.apply("p1", 4, [("a", 0, 0)], now_s=1.001) == "stale"
    assert peers.apply("p1", 5, [("a", 0, 0)], now_s=1.001) == "stale"
    assert [c.inflight for c in peers.add_to(OWN, 1.01)] == [6, 0]
    # A report carries absolute counts for the replicas that changed: the others stay as last reported.
    assert peers.apply("p1", 6, [("b", 1, 1)], now_s=1.002) == "applied"
    assert [(c.inflight, c.waiting) for c in peers.add_to(OWN, 1.01)] == [(6, 3), (1, 1)]


def test_a_full_report_drops_the_replicas_the_peer_no_longer_reports() -> None:
    peers = PeerLoads()
    peers.apply("p1", 1, [("a", 4, 2), ("b", 3, 1)], now_s=1.0)
    peers.apply("p1", 2, [("b", 1, 0)], now_s=1.1, full=True)  # "a" left that router's view
    assert [(c.inflight, c.waiting) for c in peers.add_to(OWN, 1.2)] == [(2, 1), (1, 0)]


def test_replicas_this_router_does_not_route_to_are_left_out() -> None:
    peers = PeerLoads()
    peers.apply("p1", 1, [("a", 4, 2), ("gone", 9, 9)], now_s=1.0, known={"a", "b"})
    assert peers._peers["p1"].counts == {"a": (4, 2)}


def test_peers_replicas_and_counts_are_bounded() -> None:
    peers = PeerLoads(max_age_s=1.0, max_peers=2, max_replicas=2, max_count=10)
    assert peers.apply("p1", 1, [("a", 10**9, -5), ("b", 1, 1), ("c", 1, 1)], now_s=0.0) == "applied"
    assert [(c.inflight, c.waiting) for c in peers.add_to(OWN, 0.0)] == [(12, 1), (1, 1)]  # clamped to 10 and 0
    assert len(peers._peers["p1"].counts) == 2  # "c" was past max_replicas
    assert peers.apply("p2", 1, [("a", 1, 1)], now_s=0.0) == "applied"
    assert peers.apply("p3", 1, [("a", 1, 1)], now_s=0.5) == "refused"  # two live peers already
    assert peers.apply("p3", 1, [("a", 1, 1)], now_s=2.0) == "applied"  # they aged out: room again
    assert peers.live_peers(2.0) == 1


def test_settings_out_of_bounds_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_age_s"):
        PeerLoads(max_age_s=0)
    with pytest.raises(ValueError, match="max_peers"):
        PeerLoads(max_peers=0)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


async def three_routers(clock: Clock) -> list[Fleet]:
    routers = []
    for _ in range(3):
        fleet = Fleet(RouterSettings(), NoWakeSignal(), RouterMetrics(), clock=clock)
        source = StaticReplicaSource()
        source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=16))
        for i in range(3):
            source.add("m", f"r{i}", f"http://127.0.0.1:{9000 + i}")
        await source.start(fleet)
        routers.append(fleet)
    return routers


def peers(fleet: Fleet) -> PeerLoads:
    found = fleet.peer_loads("m")
    assert found is not None
    return found


def report(routers: list[Fleet], seqs: list[int]) -> None:
    """Each router's own counts to the two others (what the transport carries, here by direct call)."""
    for i, fleet in enumerate(routers):
        seqs[i] += 1
        inflight, waiting = fleet.inflight("m"), fleet.waiting("m")
        counts = [(r, inflight[r], waiting[r]) for r in inflight]
        for j, other in enumerate(routers):
            if j != i:
                assert peers(other).apply(f"router-{i}", seqs[i], counts, other._clock(), known=inflight) == "applied"


async def test_three_routers_with_reported_load_spread_uncached_prompts_instead_of_herding() -> None:
    """Three routers each get one prompt nothing holds while the replicas are idle. On its own counts each
    sees three empty queues and makes the same choice, so all three queue on one replica; with the
    peers' counts reported after each pick, each sends to a replica no other router has just filled."""
    clock = Clock()
    routers = await three_routers(clock)
    seqs = [0, 0, 0]
    held: list[ReplicaLease] = []
    for n, fleet in enumerate(routers):
        held.append(await fleet.acquire("m", [1000 + n]))
        report(routers, seqs)
    assert sorted(lease.replica_id for lease in held) == ["r0", "r1", "r2"]
    assert peers(routers[2]).live_peers(clock.now_s) == 2
    for lease in held:
        lease.release("ok")
    for fleet in routers:
        await fleet.close()


async def test_without_reports_or_once_they_age_out_each_router_picks_on_its_own_counts() -> None:
    clock = Clock()
    routers = await three_routers(clock)
    alone = [await fleet.acquire("m", [2000 + n]) for n, fleet in enumerate(routers)]
    assert len({lease.replica_id for lease in alone}) == 1  # no reports: the same choice, three times
    for lease in alone:
        lease.release("ok")
    seqs = [0, 0, 0]
    busy = await routers[0].acquire("m", [3000])
    report(routers, seqs)
    clock.now_s += 1.5  # past peer_load_max_age_s (1 s): router 0 is no longer heard
    assert peers(routers[1]).live_peers(clock.now_s) == 0
    again = await routers[1].acquire("m", [3001])
    assert again.replica_id == busy.replica_id  # router 0's request there is no longer counted
    for lease in (busy, again):
        lease.release("ok")
    assert routers[1].peer_loads("other") is None  # a model this router does not serve
    for fleet in routers:
        await fleet.close()
