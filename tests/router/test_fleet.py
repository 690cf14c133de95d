"""The fleet in process: memory bounds over many prompts, replicas that leave, and the HTTP wake signal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from kvfleet.router.errors import ModelNotFoundError, UpstreamAttemptError
from kvfleet.router.fleet import Fleet
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.prompt import block_hashes
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import HttpWakeSignal, NoWakeSignal, WakeError
from kvfleet.spec import RoutingSpec


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.mark.slow
async def test_memory_stays_bounded_over_100k_distinct_prompts() -> None:
    capacity = 2048
    settings = RouterSettings(prefix_index_blocks_per_replica=capacity)
    fleet = Fleet(settings, NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=64))
    for i in range(4):
        source.add("m", f"r{i}", f"http://127.0.0.1:{9000 + i}")
    await source.start(fleet)

    async def route(start: int, stop: int) -> None:
        for n in range(start, stop):
            # ~600 characters, distinct from the first block on: nothing is shared, everything is new.
            prompt = f"{n:08d} " + "distinct prompt text " * 28
            lease = await fleet.acquire("m", block_hashes(prompt, model="m", block_chars=64, max_blocks=2048))
            lease.release("ok")

    await route(0, 10_000)  # fills every replica's LRU to its bound
    assert fleet.index_entries("m") == 4 * capacity
    baseline = rss_bytes()
    await route(10_000, 100_000)
    growth = rss_bytes() - baseline
    assert fleet.index_entries("m") == 4 * capacity
    assert growth < 16 * 1024 * 1024, f"RSS grew {growth / 2**20:.1f} MiB over 90k prompts"
    # Replicas that leave are forgotten entirely.
    source.remove("m", "r0")
    source.remove("m", "r1")
    assert fleet.index_entries("m") == 2 * capacity
    assert fleet.index("m").replicas() == ["r2", "r3"]  # type: ignore[union-attr]
    source.remove_deployment("m")
    assert fleet.index_entries() == 0
    await fleet.close()


async def test_a_url_change_behind_the_same_id_forgets_its_cache() -> None:
    fleet = Fleet(RouterSettings(), NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.add("m", "r0", "http://127.0.0.1:9000")
    await source.start(fleet)
    hashes = block_hashes("x" * 1024, model="m", block_chars=128, max_blocks=100)
    (await fleet.acquire("m", hashes)).release("ok")
    assert fleet.index_entries("m") == 8
    source.add("m", "r0", "http://127.0.0.1:9001")  # restarted elsewhere: a cold cache
    assert fleet.index_entries("m") == 0


async def two_replicas(strategy: str = "round-robin") -> tuple[Fleet, StaticReplicaSource]:
    fleet = Fleet(RouterSettings(), NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(strategy=strategy))  # type: ignore[arg-type]
    source.add("m", "r0", "http://127.0.0.1:9000")
    source.add("m", "r1", "http://127.0.0.1:9001")
    await source.start(fleet)
    return fleet, source


async def test_first_byte_then_release_clears_waiting_then_inflight() -> None:
    fleet, _ = await two_replicas()
    lease = await fleet.acquire("m", [])
    replica = lease.replica_id
    assert (fleet.inflight("m")[replica], fleet.waiting("m")[replica]) == (1, 1)
    lease.first_byte()
    lease.first_byte()  # idempotent
    assert (fleet.inflight("m")[replica], fleet.waiting("m")[replica]) == (1, 0)
    lease.release("ok")
    lease.release("ok")  # idempotent
    assert (fleet.inflight("m")[replica], fleet.waiting("m")[replica]) == (0, 0)
    lease.first_byte()  # after release: changes nothing
    assert fleet.waiting("m")[replica] == 0
    await fleet.close()


async def test_release_without_first_byte_clears_both_and_a_retry_counts_once() -> None:
    fleet, _ = await two_replicas()
    first = await fleet.acquire("m", [])
    first.release("failed")  # refused before any byte: the retry goes elsewhere
    retry = await fleet.acquire("m", [], frozenset({first.replica_id}))
    assert retry.replica_id != first.replica_id
    assert fleet.inflight("m") == {first.replica_id: 0, retry.replica_id: 1}
    assert fleet.waiting("m") == {first.replica_id: 0, retry.replica_id: 1}
    retry.release("aborted")  # client left before the answer started
    assert fleet.inflight("m") == fleet.waiting("m") == {"r0": 0, "r1": 0}
    await fleet.close()


async def test_a_replica_back_under_the_same_id_starts_from_zero() -> None:
    fleet, source = await two_replicas()
    old = await fleet.acquire("m", [], frozenset({"r1"}))
    assert old.replica_id == "r0"
    source.remove("m", "r0")
    source.add("m", "r0", "http://127.0.0.1:9002")  # a new process: its own counts
    assert (fleet.inflight("m")["r0"], fleet.waiting("m")["r0"]) == (0, 0)
    new = await fleet.acquire("m", [], frozenset({"r1"}))
    old.first_byte()
    old.release("ok")  # the old process's request ends: the new record keeps its own request
    assert (fleet.inflight("m")["r0"], fleet.waiting("m")["r0"]) == (1, 1)
    new.release("ok")
    await fleet.close()


async def test_least_load_sends_to_the_shorter_queue_not_the_fewer_in_flight() -> None:
    fleet, _ = await two_replicas("least-load")
    a = await fleet.acquire("m", [])  # both empty: either
    a.first_byte()  # a's replica: 1 in flight, 0 waiting
    b = await fleet.acquire("m", [])  # queues level (0, 0): the fewer in flight
    assert b.replica_id != a.replica_id
    c = await fleet.acquire("m", [])  # in flight level (1, 1): the empty queue, a's replica
    assert c.replica_id == a.replica_id
    for lease in (a, b, c):
        lease.release("ok")
    await fleet.close()


async def test_http_wake_signal_posts_the_contract_body(free_port: int) -> None:
    received: list[dict[str, str]] = []
    status = 202

    async def wake(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({}, status=status)

    app = web.Application()
    app.router.add_post("/v1/wake", wake)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    signal = HttpWakeSignal(f"http://127.0.0.1:{free_port}/", timeout_s=2)
    try:
        await signal.wake("ns", "llama")
        assert received == [{"namespace": "ns", "name": "llama"}]
        status = 500
        with pytest.raises(WakeError, match="answered 500"):
            await signal.wake("ns", "llama")
    finally:
        await signal.close()
        await runner.cleanup()
    unreachable = HttpWakeSignal(f"http://127.0.0.1:{free_port}", timeout_s=1)
    with pytest.raises(WakeError, match="unreachable"):
        await unreachable.wake("ns", "llama")
    await unreachable.close()


async def test_wake_is_repeated_while_requests_wait_and_failures_do_not_fail_requests() -> None:
    calls: list[float] = []

    class FlakyWake:
        async def wake(self, namespace: str, name: str) -> None:
            calls.append(asyncio.get_running_loop().time())
            raise WakeError("autoscaler down")

    fleet = Fleet(RouterSettings(wake_min_interval_s=0.1), FlakyWake(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(max_queue_wait_seconds=5))
    await source.start(fleet)
    waiter = asyncio.create_task(fleet.acquire("m", []))
    await asyncio.sleep(0.45)
    assert 3 <= len(calls) <= 6  # at once, then every 0.1 s
    source.add("m", "r0", "http://127.0.0.1:9000")
    lease = await asyncio.wait_for(waiter, 1)
    assert lease.replica_id == "r0"
    await asyncio.sleep(0.25)
    settled = len(calls)
    await asyncio.sleep(0.25)
    assert len(calls) == settled  # stopped once a replica was there
    await fleet.close()


async def test_try_acquire_picks_without_waiting_and_never_holds_a_request() -> None:
    fleet = Fleet(RouterSettings(), NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec())
    await source.start(fleet)
    assert fleet.try_acquire("m", []) is None  # no replica: the caller falls back to acquire, which holds
    assert fleet.queue_depth("m") == 0
    source.add("m", "r0", "http://127.0.0.1:9000")
    lease = fleet.try_acquire("m", [])
    assert lease is not None and lease.replica_id == "r0" and fleet.inflight("m") == {"r0": 1}
    lease.release("ok")
    lease.release("ok")  # once only
    assert fleet.inflight("m") == {"r0": 0}
    source.mark_draining("m", "r0")
    assert fleet.try_acquire("m", []) is None and fleet.queue_depth("m") == 0
    with pytest.raises(ModelNotFoundError):
        fleet.try_acquire("unknown", [])
    await fleet.close()


async def test_a_lease_block_reports_its_outcome_by_how_it_ends() -> None:
    fleet = Fleet(RouterSettings(eject_after_failures=2), NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(strategy="round-robin"))
    source.add("m", "r0", "http://127.0.0.1:9000")
    source.add("m", "r1", "http://127.0.0.1:9001")
    await source.start(fleet)

    def picks(n: int) -> set[str]:
        chosen = set()
        for _ in range(n):
            with fleet.try_acquire("m", []) as lease:  # type: ignore[union-attr]
                chosen.add(lease.replica_id)
        return chosen

    # The client leaving (or the router refusing) is no failure of the replica's: never ejected.
    for _ in range(3):
        with pytest.raises(asyncio.CancelledError), fleet.try_acquire("m", [], frozenset({"r1"})) as lease:  # type: ignore[union-attr]
            assert lease.replica_id == "r0" and fleet.inflight("m")["r0"] == 1
            raise asyncio.CancelledError
    assert fleet.inflight("m") == fleet.waiting("m") == {"r0": 0, "r1": 0}
    assert picks(4) == {"r0", "r1"}
    # A ReplicaFailure leaving the block counts: two in a row eject r0, so only r1 is picked.
    for _ in range(2):
        with pytest.raises(UpstreamAttemptError), fleet.try_acquire("m", [], frozenset({"r1"})) as lease:  # type: ignore[union-attr]
            raise UpstreamAttemptError(lease.replica_id, "refused")
    assert fleet.inflight("m") == fleet.waiting("m") == {"r0": 0, "r1": 0}
    assert picks(4) == {"r1"}
    await fleet.close()
