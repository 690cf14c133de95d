"""The HTTP surface against a real `kvfleet engine serve` process: OpenAI shapes, SSE framing,
usage, metrics, bad input, client disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .conftest import SERVED, EngineProcess, run_engine


def metric(text: str, name: str, labels: str = f'model_name="{SERVED}"') -> float:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def abort_count(text: str) -> float:
    if 'finished_reason="abort"' not in text:
        return 0.0
    return metric(text, "vllm:request_success_total", f'finished_reason="abort",model_name="{SERVED}"')


async def get_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        return await response.text()


async def post(session: aiohttp.ClientSession, url: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with session.post(f"{url}{path}", data=data, headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.json()


async def sse_events(response: aiohttp.ClientResponse) -> list[str]:
    """Raw `data:` payloads; asserts the framing (each event one data line, then a blank line)."""
    body = (await response.read()).decode()
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, repr(event)
    return [e[len("data: ") :] for e in events]


async def test_health_and_models(engine_server: EngineProcess) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{engine_server.url}/health") as r:
            assert r.status == 200
        async with s.get(f"{engine_server.url}/v1/models") as r:
            body = await r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [SERVED]
    assert body["data"][0]["max_model_len"] == 2048


async def test_completion_usage_and_metrics_move(engine_server: EngineProcess) -> None:
    url = engine_server.url
    async with aiohttp.ClientSession() as s:
        before = await get_metrics(s, url)
        status, body = await post(
            s,
            url,
            "/v1/completions",
            {"model": SERVED, "prompt": "Hello world, hello", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
        )
        after = await get_metrics(s, url)
    assert status == 200, body
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") == 7
    prompt_delta = metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total")
    assert prompt_delta == usage["prompt_tokens"]
    ttft = "vllm:time_to_first_token_seconds_count"
    assert metric(after, ttft) == metric(before, ttft) + 1
    e2e = "vllm:e2e_request_latency_seconds_count"
    assert metric(after, e2e) == metric(before, e2e) + 1
    itl = "vllm:inter_token_latency_seconds_count"
    assert metric(after, itl) == metric(before, itl) + 6
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert metric(after, name) == 0.0
    assert "vllm:prefix_cache_queries_total" in after and "vllm:prefix_cache_hits_total" in after


async def test_token_id_prompt_and_greedy_is_deterministic(engine_server: EngineProcess) -> None:
    body = {"model": SERVED, "prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        first = await post(s, engine_server.url, "/v1/completions", body)
        second = await post(s, engine_server.url, "/v1/completions", body)
    assert first[0] == 200 and second[0] == 200
    assert first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"]
    assert first[1]["usage"]["prompt_tokens"] == 5


async def test_seeded_sampling_is_reproducible(engine_server: EngineProcess) -> None:
    body = {
        "prompt": "once upon",
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 42,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as s:
        results = [await post(s, engine_server.url, "/v1/completions", body) for _ in range(2)]
    assert [r[0] for r in results] == [200, 200]
    assert results[0][1]["choices"][0]["text"] == results[1][1]["choices"][0]["text"]


async def test_completion_stream_framing_and_usage(engine_server: EngineProcess) -> None:
    body = {
        "model": SERVED,
        "prompt": "stream me",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{engine_server.url}/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await sse_events(r)
        _, plain = await post(s, engine_server.url, "/v1/completions", {**body, "stream": False})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text_chunks = [c for c in chunks if c["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == plain["choices"][0]["text"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][key] == plain["usage"][key]


async def test_continuous_usage_stats_put_the_tokens_so_far_in_every_chunk(engine_server: EngineProcess) -> None:
    # vLLM's stream_options extension, which the router asks for to count a migrated stream's tokens.
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": SERVED, "prompt": "count me", "max_tokens": 5, "ignore_eos": True, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{engine_server.url}/v1/completions", json={**body, "stream_options": options}) as r,
    ):
        chunks = [json.loads(e) for e in (await sse_events(r))[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5, counts
    text_chunks = [c for c in chunks if c["choices"]]
    assert all("usage" in c for c in text_chunks) and counts[-2] == 5  # the last text chunk counts all 5


async def test_chat_stream(engine_server: EngineProcess) -> None:
    body = {
        "model": SERVED,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{engine_server.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            events = await sse_events(r)
        status, plain = await post(s, engine_server.url, "/v1/chat/completions", {**body, "stream": False})
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert status == 200
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"]["role"] == "assistant"
    assert plain["choices"][0]["message"]["content"] == streamed
    # ChatML: 2 messages rendered with their markers, then the generation prompt.
    assert plain["usage"]["prompt_tokens"] > 10
    assert plain["usage"]["completion_tokens"] == 5


async def test_stop_string_truncates(engine_server: EngineProcess) -> None:
    base = {"prompt": "abc", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        _, full = await post(s, engine_server.url, "/v1/completions", base)
        text = full["choices"][0]["text"]
        stop = text[3:5]
        assert stop, text
        _, stopped = await post(s, engine_server.url, "/v1/completions", {**base, "stop": [stop]})
        async with s.post(f"{engine_server.url}/v1/completions", json={**base, "stop": stop, "stream": True}) as r:
            events = await sse_events(r)
    expected = text[: text.index(stop)]
    assert stopped["choices"][0]["text"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == expected


async def test_bad_input_is_rejected_with_reasons(engine_server: EngineProcess) -> None:
    url = engine_server.url
    cases: list[tuple[str, Any, int, str]] = [
        ("/v1/completions", "{not json", 400, "malformed JSON"),
        ("/v1/completions", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, "nested too deeply"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "nope"),
        ("/v1/completions", [1, 2], 400, "JSON object"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "gpt-4"),
    ]
    async with aiohttp.ClientSession() as s:
        for path, body, want_status, want_text in cases:
            status, reply = await post(s, url, path, body)
            assert status == want_status, (body, reply)
            assert want_text in reply["error"]["message"], (body, reply)
            # OpenAI's shape: type, param and a string-or-null code on every error.
            assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
            assert reply["error"]["code"] == ("model_not_found" if want_status == 404 else None), reply
        # Field errors name the field in `param`, as OpenAI's SDKs read it.
        _, reply = await post(s, url, "/v1/completions", {"prompt": "x", "temperature": -1})
        assert reply["error"]["param"] == "temperature"
        _, reply = await post(s, url, "/v1/completions", {"prompt": "x", "model": "nope"})
        assert (reply["error"]["type"], reply["error"]["param"]) == ("not_found_error", "model")
        # Paths and methods aiohttp answers itself are OpenAI-shaped too, not plain text.
        async with s.get(f"{url}/v1/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"
        async with s.get(f"{url}/v1/completions") as r:
            error = (await r.json())["error"]
            assert r.status == 405 and error["code"] == "method_not_allowed" and r.headers["Allow"] == "POST"
            assert error["type"] == "invalid_request_error" and "param" in error


async def test_models_list_and_retrieve(engine_server: EngineProcess) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{engine_server.url}/v1/models") as r:
            (card,) = (await r.json())["data"]
        async with s.get(f"{engine_server.url}/v1/models/{SERVED}") as r:
            assert r.status == 200
            assert await r.json() == card
        async with s.get(f"{engine_server.url}/v1/models/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    assert card["id"] == SERVED and card["object"] == "model" and card["owned_by"] == "kvfleet"
    # `created` is when the server started serving the model: set, and stable across calls.
    assert isinstance(card["created"], int) and card["created"] > 1_600_000_000


async def test_too_long_prompt_names_the_lengths(engine_server: EngineProcess) -> None:
    async with aiohttp.ClientSession() as s:
        status, reply = await post(s, engine_server.url, "/v1/completions", {"prompt": [5] * 2045, "max_tokens": 10})
    assert status == 400
    message = reply["error"]["message"]
    assert "2048" in message and "2045" in message and "2055" in message


async def test_bad_input_does_not_disturb_running_requests(engine_server: EngineProcess) -> None:
    url = engine_server.url
    good = {"prompt": "keep going", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        _, alone = await post(s, url, "/v1/completions", good)
        running = asyncio.ensure_future(post(s, url, "/v1/completions", good))
        bad = [post(s, url, "/v1/completions", "{oops") for _ in range(5)]
        bad += [post(s, url, "/v1/completions", {"prompt": [5] * 3000}) for _ in range(5)]
        bad_results = await asyncio.gather(*bad)
        status, reply = await running
    assert all(r[0] == 400 for r in bad_results)
    assert status == 200
    assert reply["choices"][0]["text"] == alone["choices"][0]["text"]


async def test_disconnect_frees_blocks(engine_server: EngineProcess) -> None:
    url = engine_server.url
    body = {"prompt": "a long story", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        before = await get_metrics(s, url)
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the stream is flowing
            during = await get_metrics(s, url)
            r.close()  # the client goes away mid-stream
        assert metric(during, "vllm:num_requests_running") == 1
        assert metric(during, "vllm:kv_cache_usage_perc") > 0
        deadline = time.monotonic() + 20
        while True:
            now = await get_metrics(s, url)
            if metric(now, "vllm:num_requests_running") == 0 and metric(now, "vllm:kv_cache_usage_perc") == 0:
                break
            assert time.monotonic() < deadline, "the aborted request still holds blocks"
            await asyncio.sleep(0.1)
    assert abort_count(now) == abort_count(before) + 1
    generated = metric(now, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert generated < 1500, "it stopped early instead of running to max_tokens"


async def test_non_streaming_disconnect_frees_blocks(engine_server: EngineProcess) -> None:
    url = engine_server.url
    body = {"prompt": "another long story", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        before = await get_metrics(s, url)
        with_timeout = aiohttp.ClientTimeout(total=0.2)
        try:
            async with s.post(f"{url}/v1/completions", json=body, timeout=with_timeout) as r:
                await r.read()
        except TimeoutError:
            pass  # we hang up before the answer
        deadline = time.monotonic() + 20
        while True:
            now = await get_metrics(s, url)
            if metric(now, "vllm:num_requests_running") == 0 and metric(now, "vllm:kv_cache_usage_perc") == 0:
                break
            assert time.monotonic() < deadline, "the abandoned request still holds blocks"
            await asyncio.sleep(0.1)
    assert abort_count(now) == abort_count(before) + 1


async def test_a_queued_chat_stream_sends_nothing_before_its_first_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    """As vLLM: the role event goes out with the first token, so time to first byte is time to first token
    (what the router's TTFT histogram and its awaiting-first-byte load signal read)."""
    long = {"model": SERVED, "prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    chat = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with run_engine(tiny_model_dir, tmp_path, "--kv-blocks", "256", "--max-num-seqs", "1") as engine:
        async with aiohttp.ClientSession() as s, s.post(f"{engine.url}/v1/completions", json=long) as first:
            assert await first.content.readany()  # running: it holds the only sequence slot
            async with s.post(f"{engine.url}/v1/chat/completions", json=chat) as second:
                assert second.status == 200  # the head goes out at once
                with pytest.raises(TimeoutError):  # queued behind the first: no event yet, not even the role
                    await asyncio.wait_for(second.content.readany(), 0.5)
                first.close()  # the first request goes away and frees the slot
                events = await sse_events(second)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
