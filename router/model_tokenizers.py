"""The served models' tokenizers, by served name: the ones mounted into the router
(``kv_events_tokenizers``, loaded at start, so a missing one stops the router then, not on a
request) and the ones fetched from a model's own replicas (``tokenizer_fetch``). A mounted
tokenizer always wins: a model that has one is never fetched for, and a fetch never replaces it.
Empty, and fetching nothing, with KV events off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.replicas import DeploymentView
from kvfleet.router.settings import RouterSettings

if TYPE_CHECKING:
    from kvfleet.router.prompt_tokens import PromptTokenizer
    from kvfleet.router.tokenizer_fetch import TokenizerFetcher


class ModelTokenizers:
    """``install(key, tokenizer)`` hands a fetched tokenizer to the model with that key and says
    whether it took it (False: the model is gone)."""

    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        install: Callable[[str, PromptTokenizer], bool],
    ) -> None:
        self._by_name: dict[str, PromptTokenizer] = {}
        self._install = install
        self._mounted: frozenset[str] = frozenset()
        self.fetcher: TokenizerFetcher | None = None
        if settings.kv_events_port is None:
            return
        from kvfleet.router.prompt_tokens import load_tokenizer

        for served_name, folder in settings.kv_events_tokenizers.items():
            self._by_name[served_name] = load_tokenizer(Path(folder), settings.kv_events_token_cache_tokens)
        self._mounted = frozenset(self._by_name)
        metrics.track_token_caches(self._token_cache_samples)
        if settings.kv_events_fetch_tokenizers:
            from kvfleet.router.tokenizer_fetch import TokenizerFetcher

            self.fetcher = TokenizerFetcher(metrics, self._fetched, settings.kv_events_token_cache_tokens)

    def __bool__(self) -> bool:
        """Whether any model is tokenized (else nothing is looked up per request)."""
        return bool(self._by_name)

    def get(self, served_name: str) -> PromptTokenizer | None:
        return self._by_name.get(served_name)

    def offer(self, view: DeploymentView) -> None:
        """A new view of a model: fetch its tokenizer if it has none and a replica can serve one."""
        if self.fetcher is not None and view.served_name not in self._by_name:
            self.fetcher.offer(view)

    def forget(self, view: DeploymentView) -> None:
        """The model is gone: its fetch stops and a fetched tokenizer goes (a later model of the same
        served name may be another one); a mounted one stays."""
        if self.fetcher is not None:
            self.fetcher.forget(view.key)
            if view.served_name not in self._mounted:
                self._by_name.pop(view.served_name, None)

    async def close(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.close()

    def _fetched(self, view: DeploymentView, tokenizer: PromptTokenizer) -> None:
        if view.served_name not in self._by_name and self._install(view.key, tokenizer):
            self._by_name[view.served_name] = tokenizer

    def _token_cache_samples(self) -> list[tuple[str, int, int, int, int]]:
        """(served name, hits, misses, evictions, tokens held) of each model's prompt-piece cache."""
        from kvfleet.router.token_cache import CachedTokenizer  # loaded already: a tokenizer exists

        samples = []
        for served_name, tokenizer in list(self._by_name.items()):
            if isinstance(tokenizer, CachedTokenizer) and tokenizer.pieces.enabled:
                st = tokenizer.pieces.stats
                samples.append((served_name, st.hits, st.misses, st.evictions, st.tokens))
        return samples
