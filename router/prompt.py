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


class BlockChain(list[int]):
    """A prompt's block hashes (a list of int), able to give a process-independent hash of any prefix.

    ``stable_hash(i)`` is blake2b over the model and the text up to the end of block ``i``: what several
    router processes compare (the placement key), computed for one block per request, not for all.
    """

    __slots__ = ("_block_chars", "_model", "_text", "engine_block_size", "engine_blocks")

    def __init__(self, text: str, model: str, block_chars: int) -> None:
        super().__init__()
        self._text = text
        self._model = model
        self._block_chars = block_chars
        # The prompt's token blocks as engines report them in KV-cache events (PrefixScorer.engine_blocks_job).
        self.engine_blocks: list[int] | None = None
        self.engine_block_size = 0

    def stable_hash(self, block: int) -> int:
        if not 0 <= block < len(self):
            raise IndexError(f"block {block} out of range (0..{len(self) - 1})")
        digest = hashlib.blake2b(self._model.encode(), digest_size=8)
        digest.update(self._text[: (block + 1) * self._block_chars].encode())
        return int.from_bytes(digest.digest(), "big")


def block_hashes(text: str, *, model: str, block_chars: int, max_blocks: int) -> BlockChain:
    """Chained hashes of the whole ``block_chars``-sized blocks of ``text``, seeded by ``model``.

    Python's own ``hash`` (SipHash with a per-process random key), not blake2b: a 4k-token prompt is
    ~125 blocks, and blake2b with its bytes copies cost ~175 us of CPU per such request against ~37 us
    here (bench/router_overhead.py's micro-benchmark). The keyed hash also keeps anyone from crafting
    colliding prompts. The values mean nothing outside this process: the index lives in the router's
    memory and is never persisted or compared across processes. What routers must agree on (the
    placement key) comes from ``BlockChain.stable_hash``.
    """
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    hashes = BlockChain(text, model, block_chars)
    end = min(len(text) // block_chars, max_blocks) * block_chars
    previous = hash(model)
    for start in range(0, end, block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        hashes.append(previous)
    return hashes
