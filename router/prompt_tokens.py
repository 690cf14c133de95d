"""A request's prompt as the engine tokenizes it, in KV blocks: what engine KV-cache events are matched on.

The engine's own code does it (``kvfleet.engine.tokenizer.ModelTokenizer``: the model's
``tokenizer.json`` through the ``tokenizers`` library, the chat template from ``tokenizer_config.json``
in jinja2's sandbox), the way the engine's server calls it: a completion's text with the tokenizer's
special tokens, a chat's rendered template without (the template writes them). Token-id prompts are
used as they are. Anything the tokenizer cannot take (a template that refuses the conversation, a
body the engine would refuse) gives no blocks: the request is routed by the router's own index, and
the engine answers it as it would have.

The tokenizer comes with the engine extra (``tokenizers``, ``jinja2``), loaded only when a model is
configured for it, so a router without it still runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from kvfleet.router.kv_events import token_block_hashes

log = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    """What the router asks of a tokenizer: the engine's ``ModelTokenizer``, or the router's
    ``token_cache.CachedTokenizer`` around it."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str: ...


class TokenizerUnavailableError(RuntimeError):
    """A configured tokenizer cannot be loaded (missing package or files)."""


def load_tokenizer(model_dir: Path, cache_tokens: int | None = None) -> PromptTokenizer:
    """The model's tokenizer; chat prompts go through a piece cache of ``cache_tokens`` token ids
    (``router.token_cache``; None: its default, 0: no cache)."""
    try:
        from kvfleet.engine.errors import ModelLoadError
        from kvfleet.engine.tokenizer import ModelTokenizer
        from kvfleet.router.token_cache import DEFAULT_MAX_TOKENS, CachedTokenizer
    except ImportError as e:
        raise TokenizerUnavailableError(
            f"tokenizing prompts for KV events needs the tokenizers and jinja2 packages ({e.name} is missing): "
            "pip install 'kvfleet[engine]'"
        ) from None
    try:
        base = ModelTokenizer.from_dir(model_dir)
    except ModelLoadError as e:
        raise TokenizerUnavailableError(str(e)) from None
    cached = CachedTokenizer(base, DEFAULT_MAX_TOKENS if cache_tokens is None else cache_tokens)
    if not cached.pieces.enabled:
        log.info("%s: chat prompts are tokenized whole: %s", model_dir, cached.pieces.disabled_reason)
    return cached


def prompt_token_ids(tokenizer: PromptTokenizer, body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids as the engine computes them, or None when the engine would not take it."""
    from kvfleet.engine.errors import EngineError

    try:
        if "messages" in body:
            messages = _messages(body["messages"])
            if messages is None:
                return None
            continue_final = bool(body.get("continue_final_message", False))
            text = tokenizer.render_chat(
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)) and not continue_final,
                continue_final_message=continue_final,
            )
            return tokenizer.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
    except EngineError as e:
        log.debug("no prompt tokens: %s", e)
    except Exception as e:  # a template we did not write may fail any way: route by the index instead
        log.debug("no prompt tokens: the tokenizer or chat template failed: %r", e)
    return None


def _messages(raw: Any) -> list[dict[str, Any]] | None:
    """The messages as the engine renders them: role and the text of the content (text parts joined)."""
    if not isinstance(raw, list) or not raw:
        return None
    out: list[dict[str, Any]] = []
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return None
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            text = "".join(str(p.get("text", "")) for p in content)
        else:
            return None  # parts the engine refuses (images): it answers 400 wherever it goes
        out.append({"role": message["role"], "content": text})
    return out


def engine_block_hashes(tokenizer: PromptTokenizer, body: Mapping[str, Any], block_size: int) -> list[int] | None:
    """The prompt's token blocks, hashed as ``kv_events.CacheView`` hashes the blocks engines report.

    All of them: the body is bounded by ``max_body_bytes``, and the text blocks they are weighed
    against (``PrefixScorer``) cover the whole prompt too."""
    tokens = prompt_token_ids(tokenizer, body)
    if tokens is None:
        return None
    return token_block_hashes(tokens, block_size)
