"""Stream migration's pure parts: reading back what was sent, the continuation request, the splice."""

from __future__ import annotations

import json

from kvfleet.router.migration import Splicer, continuation, progress

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
