"""Stream migration's pure parts: reading back what was sent, the continuation request, the splice."""

from __future__ import annotations

import json

from kvfleet.router.migration import Splicer, UsageFilter, continuation, engine_body, progress, with_usage_asked

CHAT = (
    b'data: {"id":"c-1","object":"chat.completion.chunk","created":7,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"c-1","created":7,"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c-1","created":7,"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}\n\n'
)


def test_progress_reads_back_the_text_tokens_id_and_role_sent() -> None:
    sent = progress(CHAT, chat=True)
    assert (sent.response_id, sent.created, sent.model) == ("c-1", 7, "m")
    assert (sent.text, sent.chunks, sent.role_sent, sent.finish_reason, sent.done) == ("Hello", 2, True, None, False)
    assert sent.tokens == 2  # no usage in the chunks: counted by content chunks


def _chunk(text: str, completion_tokens: int | None) -> bytes:
    obj: dict[str, object] = {"id": "x", "created": 1, "choices": [{"index": 0, "text": text}]}
    if completion_tokens is not None:
        obj["usage"] = {
            "prompt_tokens": 4,
            "completion_tokens": completion_tokens,
            "total_tokens": 4 + completion_tokens,
        }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_progress_counts_tokens_from_the_engines_usage_not_chunks() -> None:
    # vLLM merges several tokens into one chunk when its reader lags: 3 chunks, 7 tokens.
    merged = _chunk("a b", 3) + _chunk(" c d e", 6) + _chunk(" f", 7)
    assert (progress(merged, chat=False).chunks, progress(merged, chat=False).tokens) == (3, 7)
    # Chunks without usage after the last count are added one each (an engine that stopped sending it).
    assert progress(merged + _chunk(" g", None) + _chunk(" h", None), chat=False).tokens == 9
    plan = continuation(
        "/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 10}, progress(merged, chat=False)
    )
    assert plan.body is not None and plan.body["max_tokens"] == 3


def test_the_engine_is_asked_for_usage_in_every_chunk_keeping_the_clients_options() -> None:
    assert engine_body({"stream": True}) == {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    mine = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert engine_body(mine) is None  # already asked: the client's bytes go as they were
    # On the wire: spliced in (the router's own vllm_xargs in the bytes kept), or merged with the client's.
    raw = b'{"vllm_xargs":{"kv_cache_report_mode":"full"},"model":"m","stream":true}'
    spliced = json.loads(with_usage_asked(raw, {"model": "m", "stream": True}) or b"")
    assert spliced["vllm_xargs"] == {"kv_cache_report_mode": "full"}
    assert spliced["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    theirs = b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'
    merged = json.loads(with_usage_asked(theirs, json.loads(theirs)) or b"")
    assert merged["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert with_usage_asked(json.dumps(mine).encode(), mine) is None


def test_the_client_gets_only_the_usage_it_asked_for() -> None:
    final = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":7,"total_tokens":11}}\n\n'
    stream = _chunk("a", 1) + _chunk(" b", 2) + final + b"data: [DONE]\n\n"

    def usages(raw: bytes) -> list[object]:
        return [e.get("usage") for e in map(json.loads, raw.decode().split("data: ")[1:-1])]

    none = UsageFilter({"stream": True}).apply(stream)
    assert usages(none) == [None, None] and none.endswith(b"data: [DONE]\n\n")
    final_only = UsageFilter({"stream": True, "stream_options": {"include_usage": True}}).apply(stream)
    assert usages(final_only) == [None, None, {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}]
    every = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert UsageFilter(every).apply(stream) == stream
    plain = _chunk("a", None)
    assert UsageFilter({"stream": True}).apply(plain) is plain  # no usage: the bytes as they came


def test_chat_continues_the_partial_assistant_message_with_fewer_tokens() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    plan = continuation("/v1/chat/completions", body, progress(CHAT, chat=True))
    assert plan.body is not None
    assert plan.body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert plan.body["continue_final_message"] is True and plan.body["add_generation_prompt"] is False
    assert plan.body["max_tokens"] == 8 and body["max_tokens"] == 10  # the original is untouched
    # A request that already continued an assistant message extends that message.
    body2 = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Well, "}]}
    plan2 = continuation("/v1/chat/completions", {**body2, "continue_final_message": True}, progress(CHAT, chat=True))
    assert plan2.body is not None and plan2.body["messages"][-1]["content"] == "Well, Hello"


def test_completions_append_the_text_and_default_max_tokens_is_16() -> None:
    sent = progress(b'data: {"id":"x","created":1,"choices":[{"index":0,"text":"ab"}]}\n\n', chat=False)
    plan = continuation("/v1/completions", {"model": "m", "prompt": "Say:"}, sent)
    assert plan.body == {"model": "m", "prompt": "Say:ab", "max_tokens": 15}
    ids = continuation("/v1/completions", {"model": "m", "prompt": [1, 2]}, sent)
    assert ids.body is None and "token ids" in ids.reason
    spent = continuation("/v1/completions", {"model": "m", "prompt": "Say:", "max_tokens": 1}, sent)
    assert spent.body is None and spent.remaining_tokens == 0


def test_the_splice_keeps_id_created_and_one_role_and_counts_usage_once() -> None:
    splicer = Splicer(progress(CHAT, chat=True), chat=True)
    cont = (
        b'data: {"id":"c-2","created":9,"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"finish_reason":null}]}\n\n'
        b'data: {"id":"c-2","created":9,"choices":[{"index":0,"delta":{"content":" world"},"finish_reason":"stop"}]}'
        b"\n\n"
        b'data: {"id":"c-2","created":9,"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,'
        b'"total_tokens":15}}\n\n'
        b"data: [DONE]\n\n"
    )
    out = splicer.rewrite(cont).decode().split("\n\n")
    events = [e.removeprefix("data: ") for e in out if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 2  # the second role chunk is gone
    assert {(c["id"], c["created"]) for c in chunks} == {("c-1", 7)}
    assert chunks[0]["choices"][0]["delta"] == {"content": " world"}
    assert chunks[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
