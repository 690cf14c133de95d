"""The router's prompt-piece token cache gives exactly the ids of tokenizing the whole prompt."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.tokenizer import ModelTokenizer
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.prompt_tokens import load_tokenizer, prompt_token_ids
from kvfleet.router.token_cache import MIN_CACHED_CHARS, CachedTokenizer, SegmentTokenCache

WORDS = ["drill", "concrete", " bit", "héllo", "wörld", "你好", "\n", "  ", "manual", "cite", ".", "!", "x"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=1, hidden=32, vocab=1024)


def conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    def text(n: int) -> str:
        return "".join(rng.choice(WORDS) for _ in range(n))

    messages = [{"role": "system", "content": text(rng.randint(0, 200))}]
    for i in range(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text(rng.randint(0, 60))})
    return messages


def test_chat_prompts_tokenize_to_the_same_ids_and_repeated_pieces_hit(tiny_model: Path) -> None:
    whole = ModelTokenizer.from_dir(tiny_model)
    cached = load_tokenizer(tiny_model)
    assert isinstance(cached, CachedTokenizer)
    pieces = cached.pieces
    assert pieces.enabled, pieces.disabled_reason
    rng = random.Random(7)
    history = conversation(rng, 1)
    for _ in range(40):  # a conversation growing turn by turn, plus unrelated ones in between
        history = [*history, *conversation(rng, 1)[1:]]
        for body in ({"messages": history}, {"messages": conversation(rng, rng.randint(1, 4))}):
            assert prompt_token_ids(cached, body) == prompt_token_ids(whole, body)
    assert pieces.stats.hits > 40, pieces.stats  # every earlier turn of the growing conversation
    # Completions add the tokenizer's own special tokens: the cache is not used, and the ids agree too.
    assert prompt_token_ids(cached, {"prompt": "héllo " * 50}) == prompt_token_ids(whole, {"prompt": "héllo " * 50})


def test_the_cache_holds_at_most_its_bound(tiny_model: Path) -> None:
    base = ModelTokenizer.from_dir(tiny_model)
    cache = SegmentTokenCache(base.tokenizer, max_tokens=500)
    texts = [f"<|im_start|>system\n{f'document number {i} about drills ' * 8}<|im_end|>" for i in range(20)]
    for text in texts:
        assert cache.encode(text) == base.encode(text, add_special_tokens=False)
    assert 0 < cache.stats.tokens <= 500 and cache.stats.evictions > 0, cache.stats
    assert cache.encode(texts[-1]) == base.encode(texts[-1], add_special_tokens=False)
    assert cache.stats.hits == 1  # the latest stayed; the first ones were evicted
    assert cache.encode(texts[0]) == base.encode(texts[0], add_special_tokens=False) and cache.stats.hits == 1
    short = "<|im_start|>" + "x" * (MIN_CACHED_CHARS - 1)
    cache.encode(short)
    assert cache.stats.misses == 21, "a short piece is tokenized each time, never stored"
    with pytest.raises(ValueError, match="max_tokens"):
        SegmentTokenCache(base.tokenizer, max_tokens=-1)


def metaspace_tokenizer(prepend_scheme: str, added: AddedToken | None = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "[INST]"])
    tokenizer.train_from_iterator(["hello world this is a test", "newline first leading space trailing"] * 50, trainer)
    if added is not None:
        tokenizer.add_special_tokens([added])
    return tokenizer


def test_a_tokenizer_whose_pieces_tokenize_differently_alone_gets_no_cache() -> None:
    # Metaspace's prepend_scheme "first" marks only the input's start: a piece tokenized alone would
    # get the mark it does not get in place. The probe at load sees it; every encode is then whole.
    tokenizer = metaspace_tokenizer("first")
    cache = SegmentTokenCache(tokenizer, max_tokens=1000)
    assert not cache.enabled and "tokenize differently alone" in (cache.disabled_reason or "")
    text = "[INST]hello world[INST]this is a test of things" * 3
    assert cache.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
    assert SegmentTokenCache(metaspace_tokenizer("always"), max_tokens=1000).enabled


def test_an_added_token_that_strips_whitespace_gets_no_cache() -> None:
    tokenizer = metaspace_tokenizer("always", AddedToken("<mask>", lstrip=True, special=True))
    cache = SegmentTokenCache(tokenizer, max_tokens=1000)
    assert not cache.enabled and "'<mask>' strips whitespace" in (cache.disabled_reason or "")
    assert not SegmentTokenCache(tokenizer, max_tokens=0).enabled


def test_the_cache_counts_are_exported(tiny_model: Path) -> None:
    cached = load_tokenizer(tiny_model)
    body = {"messages": [{"role": "system", "content": "you answer briefly and cite the manual " * 4}]}
    for _ in range(3):
        prompt_token_ids(cached, body)
    assert isinstance(cached, CachedTokenizer)
    pieces = cached.pieces
    metrics = RouterMetrics()
    st = pieces.stats
    metrics.track_token_caches(lambda: [("tiny", st.hits, st.misses, st.evictions, st.tokens)])
    text = metrics.render().decode()
    assert 'kvfleet_router_token_cache_hits_total{model="tiny"} 2.0' in text
    assert 'kvfleet_router_token_cache_misses_total{model="tiny"} 1.0' in text
    assert f'kvfleet_router_token_cache_tokens{{model="tiny"}} {float(st.tokens)}' in text
