"""Tokenizing a chat prompt once per distinct piece: the router's prompt-to-token cache for KV events.

With KV events on, the router tokenizes every prompt the way the engine does; a long prompt costs
milliseconds of CPU (docs/benchmarks/kv_events.md), and chat traffic sends the same text again and
again: a tenant's system prompt in each of its requests, every earlier turn of a conversation in
each next one.

The ``tokenizers`` library splits its input on the added tokens (``<|im_start|>``...) before
anything else and tokenizes the text between them on its own; a chat template wraps every message
in such tokens. So a rendered conversation's ids are the ids of its pieces, each piece tokenized
alone, and a piece seen before need not be tokenized again. The cache keys a piece by its 128-bit
BLAKE2b digest and holds its ids in a compact array; least recently used pieces are dropped past
``max_tokens``.

Equivalence is checked, not assumed: a tokenizer with an added token that strips whitespace or
matches single words, or whose pieces tokenize differently alone than in place (the probe at load
catches, e.g., a pre-tokenizer that marks only the text's very start), gets no cache, only the
library's own ``encode``. A wrong id would only cost routing quality (the engines tokenize for
themselves), but the router's figures would be wrong, so it is refused rather than risked.
"""

from __future__ import annotations

import hashlib
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tokenizers library comes with an extra; this module is imported without it
    from tokenizers import Tokenizer

    from kvfleet.engine.tokenizer import ModelTokenizer

DEFAULT_MAX_TOKENS = 2_000_000
"""Token ids held per model by default: 8 MB of arrays, enough for a few hundred long system prompts
and the histories of the conversations in flight."""

MIN_CACHED_CHARS = 64
"""Shorter pieces (a role header, a newline between messages) are tokenized each time: microseconds,
and caching them would fill the cache with entries worth nothing."""

PROBE_TEXT = "Hello, world!  {t} leading space{t}\nnewline first{t}Trailing space {t}{t}héllo wörld 你好 x{t}"
"""Pieces that start with a letter, a space and a newline, end with a space, and sit between two
added tokens: where a tokenizer that treats its input's start specially would differ."""


@dataclass
class TokenCacheStats:
    hits: int = 0
    """Pieces whose ids came from the cache."""
    misses: int = 0
    """Pieces tokenized and stored."""
    evictions: int = 0
    tokens: int = 0
    """Token ids held now (the bound is ``max_tokens``)."""


class SegmentTokenCache:
    """``encode(text)`` equal to ``tokenizer.encode(text, add_special_tokens=False).ids``, tokenizing
    only pieces between added tokens it has not seen. Thread-safe: the router tokenizes large bodies
    in worker threads."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int) -> None:
        if not 0 <= max_tokens <= 100_000_000:
            raise ValueError(f"max_tokens must be in [0, 100000000], got {max_tokens}")
        self._tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.stats = TokenCacheStats()
        self._entries: OrderedDict[bytes, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._split: re.Pattern[str] | None = None
        self._special_ids: dict[str, int] = {}
        self.disabled_reason = self._prepare() if max_tokens > 0 else "max_tokens is 0"

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def _prepare(self) -> str | None:
        """Why the cache cannot be exact for this tokenizer, or None when it can (and is set up)."""
        added = self._tokenizer.get_added_tokens_decoder()
        if not added:
            return "the tokenizer has no added tokens to split on"
        for token in added.values():
            if token.lstrip or token.rstrip or token.single_word:
                return f"added token {token.content!r} strips whitespace or matches single words"
        self._special_ids = {token.content: token_id for token_id, token in added.items()}
        # Longest first: the library matches the longest added token at a position.
        contents = sorted(self._special_ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")
        for content in contents[:4]:
            probe = PROBE_TEXT.format(t=content)
            whole = list(self._tokenizer.encode(probe, add_special_tokens=False).ids)
            pieces = self._encode_pieces(probe, store=False)
            if pieces != whole:
                self._split = None
                return f"pieces between {content!r} tokenize differently alone than in place"
        return None

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return self._encode_pieces(text, store=True)

    def _encode_pieces(self, text: str, *, store: bool) -> list[int]:
        assert self._split is not None
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # re.split with one group: odd items are the added tokens themselves
                ids.append(self._special_ids[piece])
            elif len(piece) < MIN_CACHED_CHARS or not store:
                if piece:
                    ids.extend(self._tokenizer.encode(piece, add_special_tokens=False).ids)
            else:
                ids.extend(self._cached(piece))
        return ids

    def _cached(self, piece: str) -> array[int]:
        key = hashlib.blake2b(piece.encode(), digest_size=16).digest()
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return found
        tokens = array("I", self._tokenizer.encode(piece, add_special_tokens=False).ids)
        if len(tokens) > self.max_tokens:
            return tokens  # larger than the whole cache: used, never stored
        with self._lock:
            self.stats.misses += 1
            if key not in self._entries:
                self._entries[key] = tokens
                self.stats.tokens += len(tokens)
            while self.stats.tokens > self.max_tokens:
                _, dropped = self._entries.popitem(last=False)
                self.stats.tokens -= len(dropped)
                self.stats.evictions += 1
        return tokens


class CachedTokenizer:
    """The engine's tokenizer, whose chat-prompt encode (no special tokens added: the template writes
    them) goes through the piece cache; everything else is the engine's own."""

    def __init__(self, base: ModelTokenizer, max_tokens: int) -> None:
        self.base = base
        self.pieces = SegmentTokenCache(base.tokenizer, max_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            return self.pieces.encode(text)
        return self.base.encode(text, add_special_tokens=True)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        return self.base.render_chat(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
        )
