"""A router's fleet subscribed over real ZeroMQ sockets to publishers the test drives: views follow
the batches, bad and flooding batches are counted and skipped, a lost publisher degrades the replica
to the learned index and a restarted one is picked up again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest
from support.event_publisher import Publisher, publish_until_usable, usable

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.tokenizer import ModelTokenizer
from kvfleet.router.fleet import Fleet
from kvfleet.router.kv_events import token_block_hashes
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.prompt_tokens import prompt_token_ids
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import RoutingSpec

from .conftest import route_as_the_proxy, until


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=1, hidden=32, vocab=512)


def counter(fleet: Fleet, name: str, *labels: str) -> float:
    series = getattr(fleet._metrics, name)
    return float(series.values.get(("default", "m", *labels), 0.0))


async def make_fleet(tiny_model: Path, publishers: list[Publisher], **overrides: object) -> Fleet:
    settings = RouterSettings(
        kv_events_port=1,  # every replica here names its own port
        kv_events_tokenizers={"m": str(tiny_model)},
        kv_events_reconnect_s=0.05,
        kv_events_reconnect_max_s=0.2,
        placement=False,
        kv_events_replay=False,  # these publishers have no replay socket (test_kv_replay.py has)
        **overrides,  # type: ignore[arg-type]
    )
    fleet = Fleet(settings, NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=16))
    for i, p in enumerate(publishers):
        source.add("m", f"r{i}", f"http://127.0.0.1:{9000 + i}", kv_events_port=p.port)
    await source.start(fleet)
    return fleet


def held(fleet: Fleet, replica: str, tokens: list[int]) -> int:
    state = fleet.engine_caches("m").get(replica)  # type: ignore[union-attr]
    return state.view.matched_blocks(token_block_hashes(tokens, 4)) if state else 0


def pick(fleet: Fleet, body: dict[str, object]) -> str:
    return route_as_the_proxy(fleet, body)[0]


async def test_picks_follow_what_engines_report(tiny_model: Path, publishers: list[Publisher]) -> None:
    fleet = await make_fleet(tiny_model, publishers)
    try:
        prompt = list(range(1, 41))  # 10 token blocks of 4
        await publish_until_usable(fleet, publishers[1], "r1", [500] * 4, 1000)
        await publish_until_usable(fleet, publishers[0], "r0", prompt, 2000)
        # This router never sent the prompt anywhere; r0's engine says it holds it (without events the
        # first pick of equal candidates would be r1: MaxScorePicker's rotation).
        assert [pick(fleet, {"prompt": prompt}) for _ in range(3)] == ["r0"] * 3
        # r0 drops everything (its view is now complete: the truth), r1 stores it: the picks move, though
        # this router's index remembers sending the prompt to r0 three times.
        publishers[0].send_raw(msgpack.packb([1.0, [{"type": "AllBlocksCleared"}]]))
        publishers[1].store(prompt, 3000)
        await until(lambda: held(fleet, "r1", prompt) == 10 and held(fleet, "r0", prompt) == 0, timeout_s=5)
        assert pick(fleet, {"prompt": prompt}) == "r1"
        # Text and chat prompts are tokenized as the engine does (its own tokenizer and chat template).
        tokenizer = ModelTokenizer.from_dir(tiny_model)
        text = "the same long document about routing " * 8
        publishers[0].store(tokenizer.encode(text)[:40], 4000)
        messages = [{"role": "system", "content": "you answer briefly " * 6}, {"role": "user", "content": "hi"}]
        chat_ids = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
        publishers[1].store(chat_ids[: len(chat_ids) // 4 * 4], 5000)
        await until(lambda: held(fleet, "r0", tokenizer.encode(text)) == 10, timeout_s=5)
        await until(lambda: held(fleet, "r1", chat_ids) == len(chat_ids) // 4, timeout_s=5)
        assert pick(fleet, {"prompt": text}) == "r0"
        assert pick(fleet, {"messages": messages}) == "r1"
        # Again: the system prompt's ids come from the router's token cache, and the fleet exports it.
        assert pick(fleet, {"messages": messages}) == "r1"
        exported = fleet._metrics.render().decode()
        assert 'kvfleet_router_token_cache_hits_total{model="m"} 1.0' in exported, exported
        assert 'kvfleet_router_token_cache_misses_total{model="m"} 1.0' in exported
    finally:
        await fleet.close()


async def test_bad_batches_are_counted_and_skipped_never_fatal(tiny_model: Path, publishers: list[Publisher]) -> None:
    fleet = await make_fleet(tiny_model, publishers, kv_events_max_batches_per_s=50)
    try:
        await publish_until_usable(fleet, publishers[0], "r0", [7] * 4, 100)
        p = publishers[0]
        p.send_raw(b"\xc1")  # not msgpack
        p.send_raw(msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]))  # fields missing
        p.send_raw(msgpack.packb([1.0, [0] * 300_000]))  # past every bound
        p.sock.send_multipart((b"", b"\x01", b""))  # a 1-byte sequence frame
        p.send_raw(msgpack.packb([1.0, [{"type": "BlockEvicted"}]]))
        await until(lambda: counter(fleet, "kv_event_rejects", "malformed") == 2, timeout_s=5)
        await until(lambda: counter(fleet, "kv_event_rejects", "oversized") == 1, timeout_s=5)
        await until(lambda: counter(fleet, "kv_event_rejects", "framing") == 1, timeout_s=5)
        await until(lambda: counter(fleet, "kv_event_rejects", "unknown-event") == 1, timeout_s=5)
        # Lost batches: a gap is counted, and the view stops claiming what it lacks is not held.
        p.send_raw(msgpack.packb([1.0, []]), seq=p.seq + 5)
        await until(lambda: counter(fleet, "kv_event_batches", "gap") == 1, timeout_s=5)
        assert not fleet.engine_caches("m").get("r0").view.complete  # type: ignore[union-attr]
        # A flood: past 50 batches/s the rest are dropped and counted; the subscription goes on.
        for i in range(400):
            p.store([i % 50] * 4, 10_000 + i)
        await until(lambda: counter(fleet, "kv_event_rejects", "rate") > 0, timeout_s=5)
        await asyncio.sleep(1.1)  # the bucket refills
        p.store([9, 9, 9, 9], 99_999)
        await until(lambda: held(fleet, "r0", [9] * 4) == 1, timeout_s=5)
        assert usable(fleet, "r0")
        assert len(fleet.engine_caches("m").get("r0").view) <= 1 + 50 + 50 + 1  # type: ignore[union-attr]
    finally:
        await fleet.close()


async def test_a_lost_publisher_falls_back_to_the_index_and_a_restarted_one_is_used_again(
    tiny_model: Path, publishers: list[Publisher]
) -> None:
    fleet = await make_fleet(tiny_model, publishers)
    try:
        prompt = list(range(1, 41))
        await publish_until_usable(fleet, publishers[1], "r1", [500] * 4, 1000)
        await publish_until_usable(fleet, publishers[0], "r0", prompt, 2000)
        assert pick(fleet, {"prompt": prompt}) == "r0"
        port = publishers[0].port
        publishers[0].close()
        await until(lambda: not usable(fleet, "r0"), timeout_s=5)
        assert counter(fleet, "kv_event_connections", "disconnected") >= 1
        # r0's view is not used now; this router's own index remembers where it sent the prompt.
        assert pick(fleet, {"prompt": prompt}) == "r0"
        other = list(range(100, 140))
        assert fleet.engine_caches("m").get("r1").view.matched_blocks(token_block_hashes(other, 4)) == 0  # type: ignore[union-attr]
        # The engine comes back (a new process: its sequence starts at 0 and its cache is empty).
        publishers[0] = Publisher(port)
        await publish_until_usable(fleet, publishers[0], "r0", other, 7000)
        assert held(fleet, "r0", prompt) == 0, "the old process's blocks are gone from the view"
        assert held(fleet, "r0", other) == 10
        assert pick(fleet, {"prompt": other}) == "r0"
    finally:
        await fleet.close()


def test_prompts_the_engine_would_not_take_get_no_tokens(tiny_model: Path) -> None:
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    assert prompt_token_ids(tokenizer, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_token_ids(tokenizer, {"prompt": ["hello"]}) == tokenizer.encode("hello")
    assert prompt_token_ids(tokenizer, {"prompt": ["a", "b"]}) is None, "a batch: the engine refuses it"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert prompt_token_ids(tokenizer, {"messages": [{"role": "user", "content": image}]}) is None
    assert prompt_token_ids(tokenizer, {"messages": "hi"}) is None
    # A template that fails in a way jinja does not wrap (str + int): no tokens, no exception.
    broken = ModelTokenizer(tokenizer.tokenizer, chat_template="{{ messages[0].content + 1 }}")
    assert prompt_token_ids(broken, {"messages": [{"role": "user", "content": "hi"}]}) is None


def test_settings_refuse_tokenizers_without_events_and_a_missing_tokenizer_stops_the_start(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from kvfleet.router.prompt_tokens import TokenizerUnavailableError

    with pytest.raises(ValidationError, match="kv_events_tokenizers: tokenizers are only used with kv_events_port"):
        RouterSettings(kv_events_tokenizers={"m": "/models/m"})
    with pytest.raises(TokenizerUnavailableError, match=r"no tokenizer\.json"):
        Fleet(
            RouterSettings(kv_events_port=5557, kv_events_tokenizers={"m": str(tmp_path)}),
            NoWakeSignal(),
            RouterMetrics(),
        )


async def test_announced_only_subscribes_where_discovery_names_a_port(
    tiny_model: Path, publishers: list[Publisher]
) -> None:
    # As the chart runs it: the Kubernetes source names a port only where the engine publishes.
    settings = RouterSettings(
        kv_events_port=publishers[1].port,
        kv_events_announced_only=True,
        kv_events_tokenizers={"m": str(tiny_model)},
        kv_events_reconnect_s=0.05,
        placement=False,
    )
    fleet = Fleet(settings, NoWakeSignal(), RouterMetrics())
    source = StaticReplicaSource()
    source.set_deployment("m", routing=RoutingSpec(prefix_block_chars=16))
    source.add("m", "r0", "http://127.0.0.1:9000", kv_events_port=publishers[0].port)
    source.add("m", "r1", "http://127.0.0.1:9001")  # publishes on the default port, but does not say so
    await source.start(fleet)
    try:
        tokens = list(range(1, 9))
        await publish_until_usable(fleet, publishers[0], "r0", tokens, 1)
        for _ in range(10):
            publishers[1].store(tokens, 1)
            await asyncio.sleep(0.02)
        caches = fleet.engine_caches("m")
        assert caches is not None and caches.get("r1") is None, "no subscription to a replica naming no port"
        # The same replica announcing its port later is subscribed to.
        source.remove("m", "r1")
        source.add("m", "r1", "http://127.0.0.1:9001", kv_events_port=publishers[1].port)
        await publish_until_usable(fleet, publishers[1], "r1", tokens, 1)
    finally:
        await fleet.close()
