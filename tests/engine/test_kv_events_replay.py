"""The engine's KV-event replay socket, in vLLM's protocol: a client that joins late gets the buffered
batches and rebuilds the pool's contents exactly; the buffer's bound, bad requests and a client
asking in a loop cost bounded work."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from kvfleet.engine.block_pool import chain_block_hashes
from kvfleet.engine.kv_events import KVEventsConfig, ZmqEventPublisher, all_blocks_cleared
from kvfleet.engine.kv_events_replay import REPLAY_BURST
from kvfleet.engine.sampling import SamplingParams
from kvfleet.free_port import pick_free_port_pair
from kvfleet.router.kv_events import CacheView, SequenceCheck, decode_batch, token_block_hashes
from kvfleet.router.kv_replay import ReplayLimits, ReplayOutcome, replay

from .conftest import make_core, run_to_completion


def _config(port: int, **fields: object) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
        topic="kv",
        **fields,  # type: ignore[arg-type]
    )


def _ask(port: int, start: int, frames: tuple[bytes, ...] | None = None) -> list[list[bytes]]:
    """vLLM's protocol by hand: a DEALER sends ("", start); every reply until the end marker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        sock.send_multipart(frames or (b"", start.to_bytes(8, "big")))
        replies: list[list[bytes]] = []
        while sock.poll(2000):
            reply = sock.recv_multipart()
            replies.append(reply)
            if reply[2] == (-1).to_bytes(8, "big", signed=True):
                return replies
        return replies
    finally:
        sock.close(0)


def test_config_takes_a_replay_endpoint_and_names_a_bad_one() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}')
    assert config.replay_endpoint == "tcp://*:5558"
    for text, words in [
        ('{"replay_endpoint": "http://x:1"}', "kv_events_config.replay_endpoint: must be a tcp://"),
        ('{"replay_endpoint": "tcp://*:5557"}', "kv_events_config.replay_endpoint: must differ from endpoint"),
        ('{"replay_endpoint": 5558}', "kv_events_config.replay_endpoint"),
    ]:
        with pytest.raises(ValueError, match=words):
            KVEventsConfig.from_json(text)


def test_replay_serves_the_buffer_from_the_asked_number_then_the_end_marker() -> None:
    port = pick_free_port_pair()
    publisher = ZmqEventPublisher(_config(port, buffer_steps=3))
    try:
        for i in range(5):
            publisher.publish([all_blocks_cleared()] * (i + 1))
        replies = _ask(port, 0)
        # Only the last 3 batches are kept (buffer_steps); each is ("", topic, sequence, payload).
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [2, 3, 4]
        assert all(r[0] == b"" and r[1] == b"kv" for r in replies[:-1])
        assert [len(msgpack.unpackb(r[3])[1]) for r in replies[:-1]] == [3, 4, 5]
        assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert [int.from_bytes(r[2], "big") for r in _ask(port, 4)[:-1]] == [4]
        assert _ask(port, 9) == [[b"", b"", (-1).to_bytes(8, "big", signed=True), b""]]
        # A malformed request gets nothing (vLLM logs and drops it); the socket goes on serving.
        assert _ask(port, 0, frames=(b"", b"\x00\x01")) == []
        assert len(_ask(port, 3)) == 3
        assert publisher.replay is not None and publisher.replay.refused == 1
    finally:
        publisher.close()


def test_a_client_asking_in_a_loop_gets_only_end_markers_past_the_rate() -> None:
    port = pick_free_port_pair()
    publisher = ZmqEventPublisher(_config(port))
    try:
        publisher.publish([all_blocks_cleared()])
        answers = [len(_ask(port, 0)) for _ in range(int(REPLAY_BURST) + 10)]
        assert answers[0] == 2
        assert 1 in answers, "past the burst a replay is only the end marker"
        assert publisher.replay is not None and publisher.replay.refused >= 1
        time.sleep(0.3)  # the bucket refills
        assert len(_ask(port, 0)) == 2
    finally:
        publisher.close()


def test_a_view_replayed_late_matches_the_pool_exactly(tiny_model_dir: Path) -> None:
    """The engine serves a workload with nobody subscribed, evictions included; the router's replay
    client and cache view then rebuild what the pool holds, block for block, and know it is complete."""
    port = pick_free_port_pair()
    core = make_core(tiny_model_dir, num_kv_blocks=12, block_size_tokens=4, kv_events=_config(port))
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        first = list(range(1, 21))
        second = [*first[:4], *range(100, 120)]
        third = list(range(200, 240))  # evicts most of the first two
        for i, prompt in enumerate((first, second, third)):
            run_to_completion(core, {str(i): prompt}, params)
        assert core.kv_cache.pool.num_evictions > 0

        async def rebuild() -> tuple[CacheView, ReplayOutcome, list[str]]:
            view, check, outcome = CacheView(max_blocks=1000), SequenceCheck(), ReplayOutcome()
            kinds = []
            async for seq, payload in replay(f"tcp://127.0.0.1:{port + 1}", 0, ReplayLimits(), outcome):
                kinds.append(check.check(seq))
                view.apply(decode_batch(payload))
            return view, outcome, kinds

        view, outcome, kinds = asyncio.run(rebuild())
        assert outcome.reason == "done" and outcome.batches == len(kinds) > 3
        assert kinds[0] == "first" and set(kinds[1:]) == {"ok"}, "batch 0 on: a complete view"
        assert len(view) == core.kv_cache.pool.num_cached
        for prompt in (first, second, third):
            engine_held = len(core.kv_cache.pool.match_prefix(chain_block_hashes(core.kv_cache.hash_seed, prompt, 4)))
            assert view.matched_blocks(token_block_hashes(prompt, 4)) == engine_held
    finally:
        core.close()


def test_a_replay_socket_that_never_answers_ends_as_a_timeout() -> None:
    port = pick_free_port_pair()  # nothing listens there: a vLLM started without replay_endpoint

    async def ask() -> tuple[list[tuple[int, bytes]], ReplayOutcome, float]:
        outcome = ReplayOutcome()
        started = time.monotonic()
        got = [b async for b in replay(f"tcp://127.0.0.1:{port + 1}", 0, ReplayLimits(idle_s=0.2), outcome)]
        return got, outcome, time.monotonic() - started

    got, outcome, took_s = asyncio.run(ask())
    assert got == [] and outcome.reason == "timeout" and "within 0.2 s" in outcome.detail
    assert took_s < 2.0


def test_full_report_mode_announces_the_blocks_a_request_hits(tiny_model_dir: Path) -> None:
    """vLLM's ``vllm_xargs.kv_cache_report_mode: "full"``: a subscriber that missed a prefix's store (it
    joined after it) learns the prefix when a request hits it; the default mode announces nothing again."""
    port = pick_free_port_pair()
    core = make_core(tiny_model_dir, num_kv_blocks=32, block_size_tokens=4, kv_events=_config(port))
    seen = 0

    def stored_since() -> list[dict[str, object]]:
        """BlockStored events published since the last call (read back through the replay socket)."""
        nonlocal seen
        replies = _ask(port, seen)[:-1]
        seen += len(replies)
        return [e for r in replies for e in msgpack.unpackb(r[3])[1] if e["type"] == "BlockStored"]

    try:
        prompt = list(range(1, 22))  # 5 full blocks, the last token left to compute
        run_to_completion(core, {"a": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
        assert stored_since(), "the first request stores the prefix (before the late subscriber joined)"
        run_to_completion(core, {"b": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
        assert stored_since() == [], "incremental: a hit is not announced again"
        full = SamplingParams(max_tokens=1, temperature=0.0, kv_cache_report_mode="full")
        run_to_completion(core, {"c": prompt}, full)
        (hit,) = stored_since()
        assert hit["parent_block_hash"] is None and len(hit["block_hashes"]) == 5  # type: ignore[arg-type]
        late = CacheView(max_blocks=1000)
        late.apply(decode_batch(msgpack.packb([0.0, [hit], 0], use_bin_type=True)))
        assert late.matched_blocks(token_block_hashes(prompt, 4)) == 5
    finally:
        core.close()


def test_report_mode_comes_from_vllm_xargs_and_a_bad_one_is_named() -> None:
    from pydantic import ValidationError

    from kvfleet.engine.protocol import CompletionRequest

    asked = CompletionRequest(prompt="hi", vllm_xargs={"kv_cache_report_mode": "full", "other": 1})
    assert asked.sampling_params(4).kv_cache_report_mode == "full"
    assert CompletionRequest(prompt="hi").sampling_params(4).kv_cache_report_mode == "incremental"
    with pytest.raises(ValidationError, match="kv_cache_report_mode must be 'incremental' or 'full'"):
        CompletionRequest(prompt="hi", vllm_xargs={"kv_cache_report_mode": "all"})
