"""Prompt text for prefix matching: render a request's prompt stably, then hash it in fixed-size blocks.

Block i's hash covers the model name and every block before it (a chain), so two prompts share block
i's hash only if they share the whole prefix up to the end of block i -- the same property an
engine's paged prefix cache has. Only whole blocks are hashed: a partial last block can never be a
cache hit on the engine either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvfleet.router.errors import BadRequestError

HASH_BYTES = 8


def render_prompt(body: Mapping[str, Any]) -> str:
    """The text a request's prefix is matched on: ``prompt`` for completions, ``messages`` for chat.

    Chat messages are rendered with fixed role separators so the same conversation always renders the
    same, and a longer conversation renders as an extension of its earlier turns.
    """
    if "messages" in body:
        return _render_messages(body["messages"])
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            return ""
        # A batch of prompts (strings) or one tokenized prompt (ints); a batch is routed by its first.
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(str(p) for p in prompt)
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in first):
            return " ".join(str(p) for p in first)
    raise BadRequestError("'prompt' must be a string, a list of strings, or a list of token ids")


def _render_messages(messages: Any) -> str:
    if not isinstance(messages, list):
        raise BadRequestError("'messages' must be a list of message objects")
    parts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError(f"'messages[{i}]' must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str):
            raise BadRequestError(f"'messages[{i}].role' must be a string")
        parts.append(f"<|{role}|>\n{_render_content(message.get('content'), i)}<|end|>\n")
    return "".join(parts)


def _render_content(content: Any, index: int) -> str:
    if content is None:
        return ""  # assistant turns with tool calls only
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict):
                raise BadRequestError(f"'messages[{index}].content' parts must be objects")
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                # Non-text parts (images, audio) take part in the prefix by their stable JSON-ish form.
                texts.append(f"<|{part.get('type')}|>{sorted((k, str(v)) for k, v in part.items())}")
        return "".join(texts)
    raise BadRequestError(f"'messages[{index}].content' must be a string, a list of parts, or null")


def block_hashes(text: str, *, model: str, block_chars: int, max_blocks: int) -> list[int]:
    """Chained hashes of the whole ``block_chars``-sized blocks of ``text``, seeded by ``model``."""
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    hashes: list[int] = []
    n_blocks = min(len(text) // block_chars, max_blocks)
    if not n_blocks:
        return hashes
    previous = hashlib.blake2b(model.encode(), digest_size=HASH_BYTES).digest()
    for i in range(n_blocks):
        block = text[i * block_chars : (i + 1) * block_chars].encode()
        previous = hashlib.blake2b(previous + block, digest_size=HASH_BYTES).digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes
