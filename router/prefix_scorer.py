"""The prompt-prefix plugin: the one place a prompt's prefix is hashed, scored and learned.

Shaped like the Gateway API Inference Extension's prefix plugin: a request's prompt is cut into
block hashes chained over the model name (``hashes``, once per request: retries and continuations
reuse them; with KV events also into the engines' token blocks, ``engine_blocks_job``), each replica
is scored by the leading blocks the prefix index believes it holds (``score``, read-only), and the
index learns where the prompt went only once a replica is picked (``learn``, called through
``picking.Strategy.learn``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfleet.router.engine_caches import EngineCaches
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import BlockChain, block_hashes, render_prompt
from kvfleet.spec import RoutingSpec

if TYPE_CHECKING:
    from kvfleet.router.picking import Candidate, PickRequest
    from kvfleet.router.prompt_tokens import PromptTokenizer

DEFAULT_BLOCK_CHARS = RoutingSpec().prefix_block_chars


@dataclass
class PrefixScorer:
    """The prompt-prefix plugin, the one place prompt prefixes are handled (the Gateway API Inference
    Extension prefix plugin's shape): it cuts a request's prompt into chained block hashes (``hashes``),
    scores each replica by the leading blocks it holds (``score``, read-only), and learns where the
    prompt went once a replica is picked (``learn``).

    Scores are absolute blocks, not the matched fraction: moving a long conversation costs its whole
    history's prefill, moving a short one little, and a fraction scores both alike. With ``caches``
    and a tokenized prompt, a replica whose KV-cache events are live is scored by what its engine
    reports holding instead (``EngineCaches.matched``: in the same text-block unit).
    """

    index: PrefixIndex
    caches: EngineCaches | None = None
    name: str = "prefix"
    model: str = ""  # the served name seeds every chain: two models never share a block
    block_chars: int = DEFAULT_BLOCK_CHARS
    max_blocks: int = 2048  # blocks hashed per prompt: bounds the CPU per request
    tokenizer: PromptTokenizer | None = None  # the model's, to match the engines' token blocks (KV events)

    def hashes(self, body: Mapping[str, Any]) -> BlockChain:
        """The request's prompt as chained block hashes (``prompt.block_hashes``); ``BadRequestError``
        when its ``prompt`` or ``messages`` are malformed."""
        return block_hashes(
            render_prompt(body), model=self.model, block_chars=self.block_chars, max_blocks=self.max_blocks
        )

    def use_tokenizer(self, tokenizer: PromptTokenizer) -> None:
        """Tokenize prompts from now on: a tokenizer that came after the model (``tokenizer_fetch``).
        Prompts hashed before keep what they have; each job reads the tokenizer once."""
        self.tokenizer = tokenizer

    def engine_blocks_job(self, body: Mapping[str, Any], hashes: Sequence[int]) -> Callable[[], None] | None:
        """The work of tokenizing the prompt into the engines' blocks, or None when nothing would read them
        (no tokenizer for the model, no usable event view).

        The result is carried on ``hashes`` (``prompt.BlockChain.engine_blocks``), so retries and
        continuations reuse it. It costs a chat-template render and a tokenization (milliseconds for a
        long prompt: docs/benchmarks/kv_events.md), so the proxy runs it off the event loop for large
        bodies; it touches nothing but ``hashes``.
        """
        tokenizer, caches = self.tokenizer, self.caches
        if caches is None or tokenizer is None or not isinstance(hashes, BlockChain):
            return None
        size = caches.block_size()
        if size is None:
            return None
        from kvfleet.router.prompt_tokens import engine_block_hashes  # the tokenizer library, only when used

        chain = hashes

        def job() -> None:
            chain.engine_blocks = engine_block_hashes(tokenizer, body, size)
            chain.engine_block_size = size

        return job

    def score(self, candidates: Sequence[Candidate], request: PickRequest) -> list[float]:
        hashes = request.hashes
        if not hashes:
            return [0.0] * len(candidates)
        matched = self.index.matched_blocks
        caches, tokens = self.caches, request.engine_blocks
        if caches is None or not tokens:  # not by_engine: the index's counts
            return [float(matched(c.replica_id, hashes)) for c in candidates]
        engine = caches.matched
        size, n = request.engine_block_size, len(hashes)
        return [engine(c.replica_id, tokens, size, n, matched(c.replica_id, hashes)) for c in candidates]

    def by_engine(self, request: PickRequest) -> bool:
        """Whether ``score`` reads the engines' reported caches (else it is the index's match count)."""
        return self.caches is not None and bool(request.engine_blocks)

    def matched(self, replica_id: str, hashes: Sequence[int]) -> int:
        """The leading blocks of the prompt the index believes the replica holds."""
        return self.index.matched_blocks(replica_id, hashes) if hashes else 0

    def learn(self, replica_id: str, hashes: Sequence[int]) -> None:
        """The prompt was sent to the replica: it now holds (or is computing) these blocks."""
        self.index.record(replica_id, hashes)
