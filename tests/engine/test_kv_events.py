"""The engine's KV-cache events: vLLM's config, the pool's records, and a real ZeroMQ subscriber whose
view (the router's decoder and cache view) matches the pool block for block, evictions included."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import zmq

from kvfleet.engine.block_pool import BlockPool, chain_block_hashes
from kvfleet.engine.kv_events import KVEventsConfig, ZmqEventPublisher, binds
from kvfleet.engine.sampling import SamplingParams
from kvfleet.router.kv_events import CacheView, SequenceCheck, decode_batch, decode_frames, token_block_hashes

from .conftest import make_core, pick_free_port, run_to_completion


def test_config_is_vllms_json_and_names_the_bad_field() -> None:
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
    )
    assert config.enabled and config.endpoint == "tcp://*:5557"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert not KVEventsConfig.from_json("{}").enabled
    for text, field in [
        ("[1]", "must be a JSON object"),
        ("{", "not JSON"),
        ('{"enable_kv_cache_event": true}', "kv_events_config.enable_kv_cache_event: unknown field"),
        ('{"publisher": "kafka"}', "kv_events_config.publisher"),
        ('{"endpoint": "http://x:1"}', "kv_events_config.endpoint"),
        ('{"replay_endpoint": "udp://*:5558"}', "kv_events_config.replay_endpoint: must be a tcp://"),
        ('{"hwm": 0}', "kv_events_config.hwm"),
    ]:
        with pytest.raises(ValueError, match=field):
            KVEventsConfig.from_json(text)


def test_pool_records_stores_and_evictions_in_order() -> None:
    pool = BlockPool(2, record_events=True)
    pool.allocate(2)
    pool.register(0, b"h0", None, [1, 2])
    pool.register(1, b"h1", b"h0", [3, 4])
    pool.register(1, b"again", b"h0", [3, 4])  # already registered: no event
    pool.release([0, 1])
    pool.allocate(1)  # evicts h1 (the tail goes first)
    assert pool.events == [
        {
            "type": "BlockStored",
            "block_hashes": [b"h0"],
            "parent_block_hash": None,
            "token_ids": [1, 2],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [b"h1"],
            "parent_block_hash": b"h0",
            "token_ids": [3, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"},
    ]
    assert BlockPool(2).events is None, "no events unless asked"
    assert BlockPool(2, record_events=True, enable_prefix_caching=False).events is None


def _drain(sub: zmq.Socket[bytes], view: CacheView, check: SequenceCheck, quiet_s: float = 0.3) -> list[str]:
    seen: list[str] = []
    while sub.poll(int(quiet_s * 1000)):
        seq, payload = decode_frames(sub.recv_multipart())
        seen.append(check.check(seq))
        view.apply(decode_batch(payload))
    return seen


def test_subscriber_view_matches_the_pool_through_evictions(tiny_model_dir: Path) -> None:
    port = pick_free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", topic="kv")
    # 12 blocks of 4 tokens: the third prompt evicts the first one's blocks.
    core = make_core(tiny_model_dir, num_kv_blocks=12, block_size_tokens=4, kv_events=config)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # PUB drops what it sends before the subscription reaches it
        view, check = CacheView(max_blocks=1000), SequenceCheck()
        params = SamplingParams(max_tokens=2, temperature=0.0)
        first = list(range(1, 21))  # 5 full blocks
        run_to_completion(core, {"a": first}, params)
        assert _drain(sub, view, check)[0] == "first"
        assert view.matched_blocks(token_block_hashes(first, 4)) == 5
        assert len(view) == core.kv_cache.pool.num_cached
        # Shares block 0 with the first; its own blocks follow.
        second = [*first[:4], *range(100, 120)]
        run_to_completion(core, {"b": second}, params)
        _drain(sub, view, check)
        assert view.matched_blocks(token_block_hashes(second, 4)) == 6
        third = list(range(200, 240))  # 10 blocks: most of the pool
        run_to_completion(core, {"c": third}, params)
        kinds = _drain(sub, view, check)
        assert set(kinds) == {"ok"}, "no batch lost or repeated"
        assert core.kv_cache.pool.num_evictions > 0
        assert view.matched_blocks(token_block_hashes(third, 4)) == 10
        assert view.matched_blocks(token_block_hashes(first, 4)) < 5, "evicted blocks left the view"
        assert len(view) == core.kv_cache.pool.num_cached
        for prompt in (first, second, third):
            engine_held = len(core.kv_cache.pool.match_prefix(chain_block_hashes(core.kv_cache.hash_seed, prompt, 4)))
            assert view.matched_blocks(token_block_hashes(prompt, 4)) == engine_held
        assert core.events is not None and core.events.dropped_batches == 0
    finally:
        sub.close(0)
        core.close()


@pytest.mark.parametrize(
    ("endpoint", "bound"),
    [
        ("tcp://*:5557", True),  # vLLM's rule: wildcard, IPv6, ipc and inproc are bound
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://collector:5557", False),  # a collector binds; the engine connects, as vLLM does
        ("tcp://10.0.0.7:5557", False),
        ("tcp://127.0.0.1:5557", True),  # loopback: local mode's engines publish on 127.0.0.1 alone
        ("tcp://localhost:5557", True),
    ],
)
def test_which_endpoints_the_publisher_binds(endpoint: str, bound: bool) -> None:
    assert binds(endpoint) is bound


def test_a_loopback_endpoint_is_bound_on_loopback() -> None:
    port = pick_free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}"))
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # the publisher holds it (a connecting one would not)
    finally:
        publisher.close()
