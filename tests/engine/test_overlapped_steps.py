"""Overlapped scheduling (step N+1 launched before step N's sampled ids are read back): the same
tokens, text and finish reasons as one step at a time, and a sequence that finished at step N never
emits the speculative token step N+1 computed for it. Run on CPU with ``async_scheduling="on"``
(on CPU it is off by default; on CUDA on)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.model_runner import LaunchedStep
from kvfleet.engine.request import EngineRequest
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.scheduler import ScheduledChunk
from kvfleet.engine.settings import EngineSettings

from .conftest import SERVED, EngineProcess, make_core, run_engine


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    outputs_after_finish: int = 0


def _drive(
    core: EngineCore, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]], max_steps: int = 5000
) -> tuple[dict[str, Result], int]:
    """Add each request at its step, step until all finish; every output kept; sampled rows counted."""
    results: dict[str, Result] = {}
    sampled_rows = 0
    launch = core.runner.launch

    def counting(chunks: list[ScheduledChunk]) -> LaunchedStep | None:
        nonlocal sampled_rows
        launched = launch(chunks)
        sampled_rows += 0 if launched is None else len(launched.seqs)
        return launched

    core.runner.launch = counting  # type: ignore[method-assign]
    last = max(arrivals)
    for step in range(max_steps):
        for request_id, prompt, params in arrivals.get(step, []):
            results[request_id] = Result()
            core.add_request(EngineRequest(request_id, prompt, params, time.monotonic()))
        if step > last and not core.has_work():
            break
        for out in core.step():
            r = results[out.request_id]
            if r.finish_reason is not None:
                r.outputs_after_finish += 1
            r.tokens.extend(out.new_token_ids)
            r.text += out.text_delta
            r.finish_reason = out.finish_reason
            r.completion_tokens = out.completion_tokens
    assert all(r.finish_reason is not None for r in results.values()), "every request finishes"
    return results, sampled_rows


def _core(model_dir: Path, overlap: bool, **settings: object) -> EngineCore:
    core = make_core(model_dir, async_scheduling="on" if overlap else "off", **settings)
    assert core.overlap is overlap
    return core


def test_async_scheduling_defaults_to_cuda_only() -> None:
    assert EngineSettings().async_scheduling_enabled("cuda")
    assert not EngineSettings().async_scheduling_enabled("cpu")
    assert EngineSettings(async_scheduling="on").async_scheduling_enabled("cpu")
    assert not EngineSettings(async_scheduling="off").async_scheduling_enabled("cuda")
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineSettings(async_scheduling="sometimes")  # type: ignore[arg-type]


def test_overlapped_steps_give_the_same_outputs_and_drop_speculative_tokens(tiny_model_dir: Path) -> None:
    rng = random.Random(7)
    prompts = {f"r{i}": [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 70))] for i in range(10)}
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # A first plain run picks, from each request's own output, a token and a text to stop on, so
    # sequences end mid-stream by stop token, stop string and EOS-like stop ids at different steps.
    plain, _ = _drive(_core(tiny_model_dir, False), {0: [(r, p, greedy) for r, p in prompts.items()]})
    params: dict[str, SamplingParams] = {}
    for i, (request_id, r) in enumerate(sorted(plain.items())):
        kind = i % 5
        if kind == 0:
            params[request_id] = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(r.tokens[3 + i],))
        elif kind == 1 and len(r.text) > 12:
            params[request_id] = SamplingParams(max_tokens=24, temperature=0.0, stop=(r.text[6:9],), ignore_eos=True)
        elif kind == 2:
            seed = 100 + i
            params[request_id] = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=seed, ignore_eos=True)
        else:
            params[request_id] = SamplingParams(max_tokens=1 + 4 * i, temperature=0.0, ignore_eos=True)
    # Arrivals spread over the first steps: decodes, prefills and finishes interleave.
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        arrivals.setdefault(2 * i, []).append((request_id, prompt, params[request_id]))
    # A small pool forces preemption too.
    plain_core, overlapped = (
        _core(tiny_model_dir, False, num_kv_blocks=14),
        _core(tiny_model_dir, True, num_kv_blocks=14),
    )
    one, one_rows = _drive(plain_core, arrivals)
    two, two_rows = _drive(overlapped, arrivals)
    assert two == one
    for core in (plain_core, overlapped):
        assert core.metrics.num_preemptions.labels("tiny")._value.get() > 0, "the small pool preempted"
        assert core.runner.uniform_steps > 20 and core.runner.varlen_steps > 0
    reasons = {r.finish_reason for r in one.values()}
    assert reasons == {"stop", "length"}, reasons
    assert all(r.outputs_after_finish == 0 for r in two.values())
    assert one_rows == sum(r.completion_tokens for r in one.values()), "one at a time, every sampled row is emitted"
    # Overlapped, a sequence stopped at step N (stop token or string) was already in step N+1:
    # those rows were sampled and dropped. Sequences ending at max_tokens are not rescheduled.
    stopped = sum(r.finish_reason == "stop" for r in two.values())
    assert two_rows == sum(r.completion_tokens for r in two.values()) + stopped


def test_aborting_a_request_with_a_step_in_flight(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir, True)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        core.add_request(EngineRequest(f"a{i}", list(range(20 + i, 40)), params, 0.0))
    seen: dict[str, int] = {}
    while not core.step_in_flight or not seen:
        for out in core.step():
            seen[out.request_id] = seen.get(out.request_id, 0) + len(out.new_token_ids)
    final = core.abort("a1")
    assert final is not None and final.finish_reason == "abort"
    while core.has_work():
        for out in core.step():
            assert out.request_id != "a1", "no output after the abort"
            seen[out.request_id] += len(out.new_token_ids)
    assert seen["a0"] == seen["a2"] == 30
    assert core.kv_cache.pool.usage() == 0.0, "every block released"


async def _completions(url: str, bodies: list[dict[str, Any]]) -> list[tuple[str, str | None, int]]:
    """Each body's text, finish reason and completion tokens, all sent at once (streamed ones joined)."""

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[str, str | None, int]:
        async with session.post(f"{url}/v1/completions", json={"model": SERVED, **body}) as r:
            assert r.status == 200, await r.text()
            if not body.get("stream"):
                got = await r.json()
                return got["choices"][0]["text"], got["choices"][0]["finish_reason"], got["usage"]["completion_tokens"]
            text, reason, tokens = "", None, 0
            for line in (await r.read()).decode().split("\n\n"):
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    for choice in chunk["choices"]:
                        text += choice["text"]
                        reason = choice["finish_reason"] or reason
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return text, reason, tokens

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, b) for b in bodies)))


@pytest.mark.slow
async def test_a_served_engine_with_overlapped_steps_answers_as_one_step_at_a_time(
    engine_server: EngineProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Through the real server and its step thread: the last step's outputs are collected when no
    # sequence is left to schedule, streams end, stop strings cut at the same place.
    base = {"temperature": 0, "ignore_eos": True}
    first = await _completions(engine_server.url, [{**base, "prompt": "hello world", "max_tokens": 12}])
    stop = first[0][0][4:6]
    assert stop.strip(), first
    bodies = [
        {**base, "prompt": "hello world", "max_tokens": 12, "stop": [stop]},
        {**base, "prompt": "hello world", "max_tokens": 12, "stop": [stop], "stream": True,
         "stream_options": {"include_usage": True}},
        *({**base, "prompt": f"request {i} of several", "max_tokens": 3 + 5 * i} for i in range(4)),
        {"prompt": "sampled", "max_tokens": 9, "temperature": 0.8, "seed": 3, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}},
    ]  # fmt: skip
    expected = await _completions(engine_server.url, bodies)
    assert expected[0][1] == "stop" and expected[2][1] == "length"
    with run_engine(tiny_model_dir, tmp_path, "--kv-blocks", "256", "--async-scheduling", "on") as overlapped:
        got = await _completions(overlapped.url, bodies)
        again = await _completions(overlapped.url, bodies[:1])
    assert got == expected
    assert again == expected[:1]
