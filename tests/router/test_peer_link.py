"""Three real routers (``RouterServer``, in this process) exchanging their load counts over UDP on
loopback (peer_link.py): each picks on the fleet's counts, forged or malformed datagrams change
nothing, and bad settings are refused by name."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvfleet.router.fleet import Fleet
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.peer_link import PeerLink, sign
from kvfleet.router.picking import Candidate
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec

KEY = b"k" * 32


def free_udp_ports(n: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def three_routers(tmp_path: Path) -> list[RouterServer]:
    key_file = tmp_path / "peer.key"
    key_file.write_bytes(KEY + b"\n")
    ports = free_udp_ports(3)
    peers = tuple(f"127.0.0.1:{p}" for p in ports)  # each router's list holds itself too, as a chart's would
    routers = []
    for port in ports:
        settings = RouterSettings(port=0, peer_load_port=port, peer_load_peers=peers, peer_load_key_file=str(key_file))
        source = StaticReplicaSource()
        source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=16))
        for i in range(3):
            source.add("m", f"r{i}", f"http://127.0.0.1:{9000 + i}")
        server = RouterServer(settings, source, NoWakeSignal())
        await server.start()
        routers.append(server)
    return routers


def fleet_inflight(fleet: Fleet) -> int:
    """The in-flight requests a router's picks see: its own plus its live peers' reports."""
    peers = fleet.peer_loads("m")
    assert peers is not None
    own = [Candidate(r, n) for r, n in fleet.inflight("m").items()]
    return sum(c.inflight for c in peers.add_to(own, fleet._clock()))


def live_peers(fleet: Fleet) -> int:
    peers = fleet.peer_loads("m")
    return peers.live_peers(fleet._clock()) if peers is not None else 0


def signed(doc: dict[str, object]) -> bytes:
    return sign(KEY, json.dumps(doc).encode())


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_three_routers_over_udp_pick_on_each_others_reported_counts(tmp_path: Path) -> None:
    routers = await three_routers(tmp_path)
    try:
        fleets = [r.fleet for r in routers]
        # Every router hears the two others (full counts every 0.25 s), and not itself.
        await until(lambda: all(live_peers(f) == 2 for f in fleets))
        held = []
        for n, fleet in enumerate(fleets):
            held.append(await fleet.acquire("m", [5000 + n]))
            # The next router picks once it has heard of this pick (the link sends within ~1 ms).
            await until(lambda n=n: all(fleet_inflight(f) == n + 1 for f in fleets))
        # On their own counts all three would have picked the same replica (test_peer_load.py shows it).
        assert sorted(lease.replica_id for lease in held) == ["r0", "r1", "r2"]
        for lease in held:
            lease.release("ok")
        assert all(r.peer_link is not None and r.peer_link.received["applied"] > 0 for r in routers)
    finally:
        for r in routers:
            await r.stop()


async def test_forged_and_malformed_datagrams_are_refused_and_change_nothing(tmp_path: Path) -> None:
    routers = await three_routers(tmp_path)
    try:
        target = routers[0]
        assert target.peer_link is not None
        port = target.peer_link.port
        body = json.dumps({"peer": "intruder", "seq": 1, "model": "m", "counts": [["r0", 999, 999]]}).encode()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for data in (
                sign(b"x" * 32, body),  # another key
                body,  # unsigned
                sign(KEY, b"not json"),
                signed({"peer": "p", "seq": "1", "model": "m", "counts": []}),
                signed({"peer": "p", "seq": 1, "model": "m", "counts": [["r0", 1]]}),
                signed({"peer": "p", "seq": 1, "model": "other", "counts": []}),
            ):
                s.sendto(data, ("127.0.0.1", port))
        received = target.peer_link.received
        await until(lambda: received["unknown model"] == 1)
        assert received["refused: bad signature"] == 2
        assert received["refused: not JSON"] == 1
        assert received["refused: peer, model or seq missing or mistyped"] == 1
        assert received["refused: a count is not [replica, in flight, waiting]"] == 1
        assert fleet_inflight(target.fleet) == 0  # nothing of the forged 999s was counted
        text = target.metrics.render().decode()
        assert 'kvfleet_router_peer_load_reports_total{outcome="refused: bad signature"} 2.0' in text
    finally:
        for r in routers:
            await r.stop()


def test_peer_load_settings_are_checked_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="peer_load_key_file: required"):
        RouterSettings(peer_load_port=7000)
    with pytest.raises(ValidationError, match="only used with peer_load_port"):
        RouterSettings(peer_load_peers=("10.0.0.1:7000",))
    with pytest.raises(ValidationError, match="is not host:port"):
        RouterSettings(peer_load_port=7000, peer_load_key_file="/k", peer_load_peers=("10.0.0.1",))
    with pytest.raises(ValidationError, match="under peer_load_max_age_s"):
        RouterSettings(peer_load_port=7000, peer_load_key_file="/k", peer_load_full_interval_s=2.0)


async def test_a_short_key_is_refused(tmp_path: Path) -> None:
    settings = RouterSettings(peer_load_port=0, peer_load_key_file=str(tmp_path / "k"))
    fleet = Fleet(RouterSettings(), NoWakeSignal(), RouterMetrics())
    with pytest.raises(ValueError, match="at least 32 bytes"):
        PeerLink(fleet, settings, b"short")


async def test_an_idle_link_sleeps_until_a_count_moves(tmp_path: Path) -> None:
    """The send loop wakes when the fleet's counts move (at most once per 1 ms interval) or a full send
    is due, not every interval: an idle router cost 3.5% of a core waking 1,000 times a second."""
    routers = await three_routers(tmp_path)
    try:
        link = routers[0].peer_link
        assert link is not None
        await until(lambda: all(live_peers(r.fleet) == 2 for r in routers))
        before = link.looks
        await asyncio.sleep(0.5)
        assert link.looks - before <= 10, f"{link.looks - before} looks in 0.5 s idle"  # full sends: 4 a second
        lease = await routers[0].fleet.acquire("m", [7])  # a count moves: the others hear it within ms
        await until(lambda: all(fleet_inflight(r.fleet) == 1 for r in routers), timeout_s=1.0)
        lease.release("ok")
        await until(lambda: all(fleet_inflight(r.fleet) == 0 for r in routers), timeout_s=1.0)
    finally:
        for r in routers:
            await r.stop()
