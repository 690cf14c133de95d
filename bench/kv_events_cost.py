"""What KV-cache events cost the router: per request (tokenizing the prompt into the engines' blocks,
scoring with event views) and per event batch (decode and apply), and the memory a view takes per block.

All in one process and one run, the path without events measured beside it (medians over rounds):
- request: the text-block hashing (``render_prompt`` + ``block_hashes``) vs that plus
  ``PrefixScorer.engine_blocks_job``' work (the chat template rendered and the prompt tokenized with the
  engine's ``ModelTokenizer``, then the token blocks hashed), for a short completion and a chat with
  a ~16k-character (~4k-token) system prompt, as bench/router_overhead.py sends; and the same through
  the router's prompt-piece cache (``router.token_cache``), with the system prompt seen before and new;
- pick: the prefix strategy over 4 replicas, learned index only vs with 4 complete event views;
- batches: ``decode_batch`` + ``CacheView.apply`` of vLLM-shaped batches (one BlockStored of 16 blocks
  of 16 tokens, one BlockRemoved of 16), per batch and per block;
- memory: tracemalloc's bytes per block held in a view (engine hash -> router hash, 32-byte sha256 keys).

The tokenizer is the tiny test model's (a 1024-token BPE trained by the ``tokenizers`` library): real
models' tokenizers (e.g. a 128k-token BPE) take somewhat longer per character; a real model's
tokenizer.json can be given with --tokenizer-dir.

    .venv/bin/python bench/kv_events_cost.py            # ~1 minute
    .venv/bin/python bench/kv_events_cost.py --tokenizer-dir /path/to/model --rounds 5

Writes docs/benchmarks/kv_events.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgpack

from kvfleet.engine.kv_events import block_stored
from kvfleet.router.engine_caches import EngineCaches
from kvfleet.router.kv_events import BlockStored, CacheView, EventBatch, decode_batch
from kvfleet.router.picking import Candidate, PickRequest, build_strategy
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import block_hashes, render_prompt
from kvfleet.router.prompt_tokens import engine_block_hashes, load_tokenizer, prompt_token_ids
from kvfleet.spec import RoutingSpec

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
BLOCK_TOKENS = 16


def per_call_us(fn: Callable[[], object], seconds: float) -> float:
    """Mean microseconds per call over at least ``seconds``."""
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(10):
            fn()
        n += 10
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n * 1e6


def bodies() -> dict[str, dict[str, Any]]:
    system = " ".join(f"Rule {i}: answer with care and cite the section it comes from." for i in range(260))
    return {
        "short completion": {"model": "m", "prompt": "Say hello to the world in one short sentence.", "max_tokens": 8},
        "4k-token chat": {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "What does rule 7 say?"}],
        },
    }


def stored_batch(seed: int, removed: list[bytes]) -> tuple[bytes, list[bytes]]:
    hashes = [hashlib.sha256(f"{seed}-{i}".encode()).digest() for i in range(16)]
    events = [
        {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": [(seed * 31 + i) % 50_000 for i in range(16 * BLOCK_TOKENS)],
            "block_size": BLOCK_TOKENS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    ]
    if removed:
        events.append({"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"})
    return msgpack.packb([time.time(), events, 0]), hashes


def measure(tokenizer_dir: Path, seconds: float) -> dict[str, Any]:
    tokenizer = load_tokenizer(tokenizer_dir, cache_tokens=0)  # every prompt tokenized whole
    cached = load_tokenizer(tokenizer_dir)  # the router's default: the prompt-piece cache on
    out: dict[str, Any] = {"request_us": {}, "pick_us": {}, "hit_report": {}}
    for name, body in bodies().items():

        def text_only(body: dict[str, Any] = body) -> object:
            return block_hashes(render_prompt(body), model="m", block_chars=128, max_blocks=512)

        def with_tokens(body: dict[str, Any] = body) -> object:
            hashes = block_hashes(render_prompt(body), model="m", block_chars=128, max_blocks=512)
            return engine_block_hashes(tokenizer, body, BLOCK_TOKENS), hashes

        def tokens_only(body: dict[str, Any] = body) -> object:
            return engine_block_hashes(tokenizer, body, BLOCK_TOKENS)

        def cached_seen(body: dict[str, Any] = body) -> object:
            return engine_block_hashes(cached, body, BLOCK_TOKENS)

        unique = 0

        def cached_new(body: dict[str, Any] = body) -> object:
            # A system prompt never seen before (another tenant's): the cache misses and stores it.
            nonlocal unique
            unique += 1
            if "messages" not in body:
                return engine_block_hashes(cached, body, BLOCK_TOKENS)
            system = {"role": "system", "content": f"Tenant {unique}. " + body["messages"][0]["content"]}
            return engine_block_hashes(cached, {**body, "messages": [system, *body["messages"][1:]]}, BLOCK_TOKENS)

        n_tokens = len(engine_block_hashes(tokenizer, body, 1) or [])
        assert engine_block_hashes(cached, body, BLOCK_TOKENS) == engine_block_hashes(tokenizer, body, BLOCK_TOKENS)
        out["request_us"][name] = {
            "prompt_tokens": n_tokens,
            "text_blocks_only": per_call_us(text_only, seconds),
            "with_engine_blocks": per_call_us(with_tokens, seconds),
            "tokenize_and_hash_only": per_call_us(tokens_only, seconds),
            "cached_system_prompt_seen": per_call_us(cached_seen, seconds),
            "cached_system_prompt_new": per_call_us(cached_new, seconds),
        }
        # The pick among 4 replicas, each known to the index and holding a part of the prompt in its view.
        text = text_only()
        tokens = engine_block_hashes(tokenizer, body, BLOCK_TOKENS) or []
        assert isinstance(text, list)
        index = PrefixIndex(100_000)
        caches = EngineCaches(100_000)
        ids = prompt_token_ids(tokenizer, body) or []
        for r in range(4):
            index.record(f"r{r}", text[: len(text) * r // 4])
            state = caches.add(f"r{r}")
            state.on_connected()
            # Replica r's engine reported r/4 of the prompt's blocks, from its first batch (a complete view).
            held = len(tokens) * r // 4
            stored = BlockStored(
                tuple(range(max(1, held))), None, tuple(ids[: max(1, held) * BLOCK_TOKENS]), BLOCK_TOKENS
            )
            state.on_batch(0, EventBatch(0.0, (stored,)))
        candidates = [Candidate(f"r{r}", r) for r in range(4)]
        plain = build_strategy(RoutingSpec(), index, load_penalty_blocks=4.0)
        with_events = build_strategy(RoutingSpec(), index, load_penalty_blocks=4.0, caches=caches)
        request_plain = PickRequest(text)
        request_events = PickRequest(text, engine_blocks=tokens, engine_block_size=BLOCK_TOKENS)
        out["pick_us"][name] = {
            "index_only": per_call_us(partial(plain.pick, candidates, request_plain), seconds),
            "with_event_views": per_call_us(partial(with_events.pick, candidates, request_events), seconds),
        }
        # A hit reported (vLLM's kv_cache_report_mode "full", the router's default): the engine announces
        # the request's whole cached prefix again, and every router applies it to a view that holds it.
        n = len(ids) // BLOCK_TOKENS
        engine_hashes = [hashlib.sha256(f"{name}-{b}".encode()).digest() for b in range(n)]
        report = msgpack.packb(
            [0.0, [block_stored(engine_hashes, None, ids[: n * BLOCK_TOKENS], BLOCK_TOKENS)], 0], use_bin_type=True
        )
        holding = CacheView(100_000)
        holding.apply(decode_batch(report))
        out["hit_report"][name] = {
            "blocks": n,
            "bytes": len(report),
            "us_per_report": per_call_us(lambda r=report, v=holding: v.apply(decode_batch(r)), seconds),
        }
    # Batches: decode + apply, a view at steady state (each batch stores 16 blocks and removes 16).
    view = CacheView(1_000_000)
    payloads: list[bytes] = []
    previous: list[bytes] = []
    for seed in range(400):
        payload, previous = stored_batch(seed, previous)
        payloads.append(payload)
    i = 0

    def apply_one() -> None:
        nonlocal i
        view.apply(decode_batch(payloads[i % len(payloads)]))
        i += 1

    batch_us = per_call_us(apply_one, seconds)
    out["batch"] = {
        "bytes": len(payloads[1]),
        "us_per_batch": batch_us,
        "us_per_block_event": batch_us / 32,
        "batches_per_s_one_core": 1e6 / batch_us,
    }
    # Memory per block held in a view.
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    big = CacheView(1_000_000)
    for seed in range(0, 100_000 // 16):
        big.apply(decode_batch(stored_batch(seed + 10_000, [])[0]))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    out["memory"] = {"blocks": len(big), "bytes_per_block": grown / max(1, len(big))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="medians over rounds are reported")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="a model folder (default: a tiny one)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.tokenizer_dir
        if folder is None:
            from kvfleet.engine.tiny_model import make_tiny_model

            folder = make_tiny_model(Path(tmp) / "tiny", layers=1, hidden=32, vocab=1024)
        rounds = [measure(folder, args.seconds) for _ in range(args.rounds)]
    summary = median_rounds(rounds)
    summary["tokenizer"] = "tiny test model (1024-token BPE)" if args.tokenizer_dir is None else str(args.tokenizer_dir)
    summary["rounds"] = args.rounds
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_events.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "kv_events.md").write_text(markdown(summary))
    print(markdown(summary))


def median_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def merge(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: merge([v[k] for v in values]) for k in values[0]}
        return round(statistics.median(values), 2)

    return dict(merge(rounds))


def markdown(s: dict[str, Any]) -> str:
    lines = [
        "# KV-cache events: the router's cost",
        "",
        f"`.venv/bin/python bench/kv_events_cost.py` (medians of {s['rounds']} rounds, one process, one core; "
        f"tokenizer: {s['tokenizer']}).",
        "",
        "| request | prompt tokens | text blocks only | + engine blocks (tokenized whole) | tokenize + hash alone "
        "| with the piece cache: system prompt seen before | ... a new one (miss, stored) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in s["request_us"].items():
        lines.append(
            f"| {name} | {r['prompt_tokens']:.0f} | {r['text_blocks_only']:.1f} us | "
            f"{r['with_engine_blocks']:.1f} us | {r['tokenize_and_hash_only']:.1f} us | "
            f"{r['cached_system_prompt_seen']:.1f} us | {r['cached_system_prompt_new']:.1f} us |"
        )
    lines += [
        "",
        "The piece cache (router/token_cache.py) tokenizes the text between a chat template's special tokens "
        "once: a request whose system prompt (or earlier turns) the router has seen tokenizes only the rest. "
        "A completion's prompt is tokenized whole (the tokenizer adds its own special tokens there).",
    ]
    lines += ["", "| pick among 4 replicas | index only | with 4 event views |", "|---|---|---|"]
    for name, r in s["pick_us"].items():
        lines.append(f"| {name} | {r['index_only']:.1f} us | {r['with_event_views']:.1f} us |")
    lines += [
        "",
        "A hit reported (`kv_cache_report_mode: full`, the router's default): the engine announces the request's "
        "cached prefix again as one BlockStored, and every router decodes and applies it to a view that holds it.",
        "",
        "| request | blocks | bytes | decode + apply per report |",
        "|---|---|---|---|",
    ]
    for name, r in s["hit_report"].items():
        lines.append(f"| {name} | {r['blocks']:.0f} | {r['bytes']:.0f} | {r['us_per_report']:.1f} us |")
    b, m = s["batch"], s["memory"]
    lines += [
        "",
        f"Event batches (BlockStored of 16 blocks x {BLOCK_TOKENS} tokens + BlockRemoved of 16, "
        f"{b['bytes']:.0f} bytes): "
        f"decode + apply {b['us_per_batch']:.1f} us per batch, {b['us_per_block_event']:.2f} us per block event, "
        f"~{b['batches_per_s_one_core']:.0f} batches/s on one core.",
        "",
        f"Memory: {m['bytes_per_block']:.0f} bytes per block held in a view ({m['blocks']:.0f} blocks measured).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
