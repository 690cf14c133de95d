"""Stream migration: continue a streamed completion on another replica after its replica broke it.

Pure parts, no I/O: what the client has received so far (``Progress``, read back from the SSE bytes
it was sent), the request that continues it (``continuation``), and the rewriting of the new
replica's events so they splice into the client's stream (``Splicer``: same ``id``, ``created`` and
index, no second role chunk, one final ``usage`` counting both parts).

Token counts: the router does not tokenize. A migratable stream is sent to its engine with
``stream_options: {include_usage, continuous_usage_stats}`` (``engine_body``), so every chunk
carries the completion tokens so far (vLLM and the reference engine both give them); the router
takes the last such count and strips what the client did not ask for (``UsageFilter``). vLLM merges
several tokens into one chunk whenever its reader lags and holds byte fragments back, so chunks are
not tokens. An engine that sends no usage falls back to counting content chunks after the last count
(exact only when each chunk carries one token; low otherwise, and the continuation then runs past
``max_tokens``). The final usage's ``prompt_tokens`` is the continuation's prompt less the tokens
sent, exact when the text sent re-tokenizes into the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# OpenAI's default max_tokens for /v1/completions (chat defaults to the rest of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Progress:
    """What the client has been sent of one streamed completion."""

    response_id: str | None
    created: int | None
    model: str | None
    text: str
    chunks: int  # content chunks
    tokens: int  # completion tokens sent: the last usage count plus content chunks after it (docstring)
    role_sent: bool
    finish_reason: str | None
    done: bool  # ``data: [DONE]`` was sent


def _events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of complete SSE events in ``raw``."""
    text = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").decode("utf-8", errors="replace")
    out = []
    for event in text.split("\n\n"):
        data = [line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def progress(sent: bytes, *, chat: bool) -> Progress:
    """Read back the stream sent so far (whole events only: the router forwards at event boundaries)."""
    response_id: str | None = None
    created: int | None = None
    model: str | None = None
    parts: list[str] = []
    chunks = 0
    counted = 0  # the last usage's completion_tokens
    since = 0  # content chunks after it
    role_sent = False
    finish: str | None = None
    done = False
    for payload in _events(sent):
        if payload == "[DONE]":
            done = True
            continue
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        response_id = response_id or _str(obj.get("id"))
        created = created if created is not None else _int(obj.get("created"))
        model = model or _str(obj.get("model"))
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if chat:
                delta = choice.get("delta") or {}
                role_sent = role_sent or "role" in delta
                piece = delta.get("content") or ""
            else:
                piece = choice.get("text") or ""
            if piece:
                parts.append(str(piece))
                chunks += 1
                since += 1
            finish = choice.get("finish_reason") or finish
        usage = obj.get("usage")
        if isinstance(usage, dict) and (tokens := _int(usage.get("completion_tokens"))) is not None:
            counted, since = tokens, 0  # a chunk's usage counts its own tokens too
    return Progress(response_id, created, model, "".join(parts), chunks, counted + since, role_sent, finish, done)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Continuation:
    """The request body to send, or why the stream cannot be continued."""

    body: dict[str, Any] | None
    reason: str
    remaining_tokens: int | None = None


def continuation(path: str, body: dict[str, Any], sent: Progress) -> Continuation:
    """The request that continues ``body`` after ``sent``: the text so far appended (chat: as a partial
    assistant message, ``continue_final_message``; completions: to the prompt), ``max_tokens`` less
    the tokens sent. Nothing sent yet: the original request as it was."""
    if not sent.text:
        return Continuation(body, "nothing generated yet: resent as it was")
    out = dict(body)
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return Continuation(None, "chat request without messages")
        last = messages[-1]
        if body.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant":
            prior = last.get("content")
            if not isinstance(prior, str):
                return Continuation(None, "final assistant message is not plain text")
            out["messages"] = [*messages[:-1], {**last, "content": prior + sent.text}]
        else:
            out["messages"] = [*messages, {"role": "assistant", "content": sent.text}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = body.get(key)
    elif path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return Continuation(None, "the prompt is token ids: text cannot be appended to it")
        out["prompt"] = prompt + sent.text
        key = "max_tokens"
        limit = body.get(key, COMPLETIONS_DEFAULT_MAX_TOKENS)
    else:
        return Continuation(None, f"{path} cannot be continued")
    remaining: int | None = None
    if isinstance(limit, int) and not isinstance(limit, bool):
        remaining = limit - sent.tokens
        if remaining <= 0:
            return Continuation(None, "max_tokens reached", remaining_tokens=0)
        out[key] = remaining
    return Continuation(out, "continued", remaining_tokens=remaining)


class Splicer:
    """Rewrites a continuation's SSE events to continue the client's stream."""

    def __init__(self, sent: Progress, *, chat: bool) -> None:
        self._sent = sent
        self._chat = chat

    def rewrite(self, raw: bytes) -> bytes:
        """Complete events in, the events to forward out."""
        out: list[bytes] = []
        for payload in _events(raw):
            if payload == "[DONE]":
                out.append(b"data: [DONE]\n\n")
                continue
            try:
                obj = json.loads(payload)
            except json.JSONDecodeError:
                out.append(b"data: " + payload.encode() + b"\n\n")
                continue
            if isinstance(obj, dict):
                if not self._keep(obj):
                    continue
                self._rebrand(obj)
            out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(out)

    def _keep(self, obj: dict[str, Any]) -> bool:
        """Drop the continuation's opening role chunk when the client already had one."""
        if not self._chat or not self._sent.role_sent:
            return True
        choices = obj.get("choices") or []
        if len(choices) != 1 or not isinstance(choices[0], dict):
            return True
        delta = choices[0].get("delta") or {}
        opening = "role" in delta and not delta.get("content") and not choices[0].get("finish_reason")
        return not opening

    def _rebrand(self, obj: dict[str, Any]) -> None:
        sent = self._sent
        if sent.response_id is not None and "id" in obj:
            obj["id"] = sent.response_id
        if sent.created is not None and "created" in obj:
            obj["created"] = sent.created
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and self._chat and "role" in (choice.get("delta") or {}) and sent.role_sent:
                del choice["delta"]["role"]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            completion = _int(usage.get("completion_tokens"))
            prompt = _int(usage.get("prompt_tokens"))
            if completion is not None:
                usage["completion_tokens"] = completion + sent.tokens
            if prompt is not None:
                usage["prompt_tokens"] = max(0, prompt - sent.tokens)
            if completion is not None and prompt is not None:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def engine_body(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body to send the engine for a stream that may need continuing: ``stream_options`` asking
    for the usage in every chunk (the client's other options kept). None: the client's own body
    already asks for it."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        return None  # the client's malformed options: the engine's 400 names them
    if options.get("include_usage") is True and options.get("continuous_usage_stats") is True:
        return None
    return {**body, "stream_options": {**options, "include_usage": True, "continuous_usage_stats": True}}


_ASK_USAGE = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true},'


def with_usage_asked(raw: bytes, body: dict[str, Any]) -> bytes | None:
    """``raw`` (whose parse is ``body``: an object) as ``engine_body`` would send it. Spliced after the
    opening brace where the client sent no ``stream_options`` (no re-encoding of a long prompt; ``raw``
    may carry more than ``body``, the router's own ``vllm_xargs``); re-encoded from ``raw`` otherwise."""
    if "stream_options" not in body:
        start = raw.index(b"{") + 1
        return raw[:start] + _ASK_USAGE + raw[start:]
    full = json.loads(raw)
    asked = engine_body({**full, "stream_options": full.get("stream_options") or {}})
    return json.dumps(asked, separators=(",", ":")).encode() if asked is not None else None


class UsageFilter:
    """Takes out of a stream's events the usage the router asked for and the client did not: the
    usage of each content chunk (unless it asked ``continuous_usage_stats``) and the closing
    usage-only chunk (unless it asked ``include_usage``)."""

    def __init__(self, body: dict[str, Any]) -> None:
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self._final = options.get("include_usage") is True
        self._continuous = self._final and options.get("continuous_usage_stats") is True

    def apply(self, raw: bytes) -> bytes:
        """Complete events in, the client's events out (unchanged bytes where nothing is taken)."""
        if self._continuous or b'"usage"' not in raw:
            return raw
        out: list[bytes] = []
        for payload in _events(raw):
            try:
                obj = json.loads(payload)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict) or "usage" not in obj:
                out.append(b"data: " + payload.encode() + b"\n\n")
                continue
            if not obj.get("choices"):  # the closing usage-only chunk
                if not self._final:
                    continue
            else:
                del obj["usage"]
            out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(out)


def finish_event(sent: Progress, *, chat: bool, reason: str = "length") -> bytes:
    """A closing chunk for a stream whose budget was spent when its replica broke."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    obj = {
        "id": sent.response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": sent.created,
        "model": sent.model,
        "choices": [choice],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
