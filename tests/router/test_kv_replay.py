"""A router that joins engines already serving rebuilds their caches from the engines' replay sockets
(the reference engine's publisher, vLLM's protocol): complete while the buffer starts at batch 0,
partial and saying so past it; a gap in the live stream is filled from the replay, so the view stays
complete; an engine without a replay socket costs one bounded wait and events flow as before."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from kvfleet.engine.kv_events import KVEventsConfig, ZmqEventPublisher, block_removed, block_stored
from kvfleet.engine.kv_events_replay import ReplayBuffer, ReplayServer
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.free_port import pick_free_port_pair
from kvfleet.router.fleet import Fleet
from kvfleet.router.kv_events import token_block_hashes
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec

from .conftest import until


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=1, hidden=32, vocab=512)


def stored(tokens: list[int], first: int, parent: int | None = None) -> dict[str, object]:
    hashes = [(first + i).to_bytes(8, "big") for i in range(len(tokens) // 4)]
    return block_stored(hashes, None if parent is None else parent.to_bytes(8, "big"), tokens, 4)


def removed(first: int, n: int) -> dict[str, object]:
    return block_removed([(first + i).to_bytes(8, "big") for i in range(n)])


@pytest.fixture
def engine() -> Iterator[tuple[ZmqEventPublisher, int]]:
    port = pick_free_port_pair()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
        buffer_steps=3,
    )
    publisher = ZmqEventPublisher(config)
    yield publisher, port
    publisher.close()


async def make_fleet(tiny_model: Path, port: int, **overrides: object) -> Fleet:
    settings = RouterSettings(
        kv_events_port=port,
        kv_events_tokenizers={"m": str(tiny_model)},
        kv_events_reconnect_s=0.05,
        kv_events_reconnect_max_s=0.2,
        placement=False,
        **overrides,  # type: ignore[arg-type]
    )
    fleet = Fleet(settings, NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=16))
    source.add("m", "r0", "http://127.0.0.1:9", kv_events_port=port)
    await source.start(fleet)
    return fleet


def state(fleet: Fleet):  # type: ignore[no-untyped-def]
    caches = fleet.engine_caches("m")
    assert caches is not None
    return caches.get("r0")


def held(fleet: Fleet, tokens: list[int]) -> int:
    s = state(fleet)
    return s.view.matched_blocks(token_block_hashes(tokens, 4)) if s else 0


def counter(fleet: Fleet, name: str, *labels: str) -> float:
    return float(getattr(fleet._metrics, name).values.get(("default", "m", *labels), 0.0))


A, B, C = list(range(1, 21)), list(range(100, 116)), list(range(200, 208))


async def test_a_late_router_rebuilds_a_complete_view_from_the_replay(
    tiny_model: Path, engine: tuple[ZmqEventPublisher, int]
) -> None:
    publisher, port = engine
    publisher.publish([stored(A, 10)])  # batch 0, with nobody subscribed
    publisher.publish([stored(B, 20)])
    publisher.publish([removed(13, 2)])  # A's last two blocks evicted
    fleet = await make_fleet(tiny_model, port)
    try:
        await until(lambda: bool(state(fleet) and state(fleet).usable), timeout_s=5)
        assert state(fleet).view.complete, "batches 0-2 replayed: the view is the engine's cache"
        assert (held(fleet, A), held(fleet, B)) == (3, 4)
        assert counter(fleet, "kv_event_replays", "done") == 1
        # Live batches follow on from the replayed ones.
        publisher.publish([stored(C, 30)])
        await until(lambda: held(fleet, C) == 2, timeout_s=5)
        assert state(fleet).view.complete
        assert counter(fleet, "kv_event_batches", "gap") == 0
    finally:
        await fleet.close()


async def test_past_the_buffer_the_view_is_partial_and_says_so(
    tiny_model: Path, engine: tuple[ZmqEventPublisher, int]
) -> None:
    publisher, port = engine
    publisher.publish([stored(A, 10)])  # batch 0 leaves the 3-batch buffer
    for i, tokens in enumerate(([500] * 4, [600] * 4, B)):
        publisher.publish([stored(tokens, 100 + 10 * i)])
    fleet = await make_fleet(tiny_model, port)
    try:
        await until(lambda: held(fleet, B) == 4, timeout_s=5)
        assert held(fleet, A) == 0 and not state(fleet).view.complete, "A is held but was stored before the buffer"
        assert state(fleet).usable
    finally:
        await fleet.close()


async def test_a_gap_in_the_live_stream_is_filled_from_the_replay(tiny_model: Path) -> None:
    """The test plays the engine: every batch goes to the replay buffer, one never reaches the PUB."""
    port = pick_free_port_pair()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    buffer = ReplayBuffer(100)
    server = ReplayServer(f"tcp://127.0.0.1:{port + 1}", buffer, b"")
    seq = 0

    def publish(events: list[dict[str, object]], *, live: bool = True) -> None:
        nonlocal seq
        payload = msgpack.packb([1.0, events, 0], use_bin_type=True)
        buffer.append(seq, payload)
        if live:
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        seq += 1

    fleet = await make_fleet(tiny_model, port)
    try:
        publish([stored(A, 10)])
        await until(lambda: bool(state(fleet) and state(fleet).usable), timeout_s=5)
        for _ in range(50):  # PUB drops what it sent before the subscription reached it: the replay has it
            if held(fleet, A) == 5:
                break
            await asyncio.sleep(0.05)
        assert held(fleet, A) == 5 and state(fleet).view.complete
        await asyncio.sleep(5.1)  # one replay per subscription per REPLAY_INTERVAL_S
        publish([stored(B, 20)], live=False)  # lost on the way (a full socket, a blip)
        publish([stored(C, 30)])
        await until(lambda: held(fleet, C) == 2, timeout_s=5)
        assert held(fleet, B) == 4, "the missing batch came from the replay"
        assert state(fleet).view.complete
        assert counter(fleet, "kv_event_batches", "gap") == 0
    finally:
        await fleet.close()
        server.close()
        pub.close(0)


async def test_an_engine_without_a_replay_socket_costs_one_bounded_wait(
    tiny_model: Path, engine: tuple[ZmqEventPublisher, int]
) -> None:
    publisher, port = engine
    fleet = await make_fleet(tiny_model, port, kv_events_replay_idle_s=0.2)
    try:
        await until(lambda: counter(fleet, "kv_event_replays", "done") == 1, timeout_s=5)
    finally:
        await fleet.close()
    publisher.close()  # the same PUB port, now without a replay socket
    plain = None
    for _ in range(100):  # ZeroMQ's I/O thread may still be releasing the port just closed
        try:
            plain = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}"))
            break
        except ValueError:
            await asyncio.sleep(0.05)
    assert plain is not None
    fleet = await make_fleet(tiny_model, port, kv_events_replay_idle_s=0.2)
    try:
        await until(lambda: counter(fleet, "kv_event_replays", "timeout") == 1, timeout_s=5)
        for _ in range(100):
            plain.publish([stored(C, 30)])
            await asyncio.sleep(0.02)
            if held(fleet, C) == 2:
                break
        assert held(fleet, C) == 2 and state(fleet).usable
    finally:
        await fleet.close()
        plain.close()


def test_requests_ask_engines_to_report_their_hits_and_a_clients_own_mode_wins() -> None:
    import json

    from kvfleet.router.proxy import with_hits_reported

    def forwarded(body: dict[str, object]) -> dict[str, object]:
        raw = json.dumps(body, indent=1).encode()
        out: dict[str, object] = json.loads(with_hits_reported(raw, body))
        return out

    plain = forwarded({"model": "m", "prompt": "x" * 100})
    assert plain == {"vllm_xargs": {"kv_cache_report_mode": "full"}, "model": "m", "prompt": "x" * 100}
    merged = forwarded({"model": "m", "vllm_xargs": {"session_id": "s"}})
    assert merged["vllm_xargs"] == {"session_id": "s", "kv_cache_report_mode": "full"}
    own = forwarded({"model": "m", "vllm_xargs": {"kv_cache_report_mode": "incremental"}})
    assert own["vllm_xargs"] == {"kv_cache_report_mode": "incremental"}
