"""A router that restarts among three, in front of real engines: does it route as well as the others?

4 reference-engine processes publishing KV-cache events (with their replay socket), 3 `kvfleet router
serve` processes subscribed to all of them and sharing their load (peer load), every request through
a router picked at random. The multi-tenant trace's first half warms the engines; then router 0 is
killed (SIGKILL) and started again, empty, on the same ports, and the second half follows. Each
request asks for its usage (``stream_options.include_usage``), so the engine's own
``cached_tokens / prompt_tokens`` is known per request and per router: the restarted router's hit rate
over the first 10 s after it is back and after, against the two others' over the same seconds.

Variants, each on fresh engines (so each router joins engines that served the first half):
- ``neither``: no replay, no hits reported (``--no-kv-events-replay --no-kv-events-report-hits``);
- ``replay (buffer 10000)``: the engines' buffer still holds batch 0 (a young engine): a complete view;
- ``replay (buffer 20) + hits reported``: the engines' buffer long past batch 0 (an engine up for
  hours), and every request asks its engine to announce its hits (the defaults' behaviour on an old engine).

    .venv/bin/python bench/router_restart_real.py      # ~5 minutes on 2 busy cores

Writes docs/benchmarks/router_restart_real.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

# Run as a script, this folder is first on sys.path: the sibling benchmarks import as top-level modules.
from router_fleet_real import SERVED, start_routers, tenants

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.free_port import pick_free_port_pair
from kvfleet_testkit.engines import Engine, start_engine

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "neither": (10_000, ["--no-kv-events-replay", "--no-kv-events-report-hits"]),
    "replay (buffer 10000)": (10_000, ["--no-kv-events-report-hits"]),
    "replay (buffer 20) + hits reported": (20, []),
}
WINDOW_S = 10.0


async def drive(
    urls: list[str], bodies: list[dict[str, Any]], rng: random.Random, concurrency: int, t0: float
) -> list[dict[str, Any]]:
    """Stream ``bodies`` through random routers; per request: router, seconds after ``t0``, tokens, cached."""
    out: list[dict[str, Any]] = []
    queue = list(reversed(bodies))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            while queue:
                body = {**queue.pop(), "stream_options": {"include_usage": True}}
                r = rng.randrange(len(urls))
                sent = time.monotonic()
                usage = None
                first = None
                async with session.post(urls[r] + "/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        out.append({"router": r, "at_s": sent - t0, "error": resp.status})
                        await resp.read()
                        continue
                    async for line in resp.content:
                        first = first or time.monotonic()
                        if line.startswith(b"data: {") and b'"usage"' in line:
                            usage = json.loads(line[6:]).get("usage") or usage
                if usage:
                    out.append(
                        {
                            "router": r,
                            "at_s": sent - t0,
                            "prompt_tokens": usage["prompt_tokens"],
                            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                            "ttft_s": (first or sent) - sent,
                        }
                    )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def restart(proc: subprocess.Popen[bytes], url: str, log: Path) -> subprocess.Popen[bytes]:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    again = subprocess.Popen(proc.args, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return again
        except OSError:
            if again.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router {url} did not come back") from None
            time.sleep(0.05)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    def rate(rs: list[dict[str, Any]]) -> float | None:
        tokens = sum(r["prompt_tokens"] for r in rs)
        return sum(r["cached_tokens"] for r in rs) / tokens if tokens else None

    ok = [r for r in records if "error" not in r]
    out: dict[str, Any] = {"requests": len(records), "errors": len(records) - len(ok)}
    for name, lo, hi in (("0-10 s", 0.0, WINDOW_S), ("10 s on", WINDOW_S, float("inf"))):
        window = [r for r in ok if lo <= r["at_s"] < hi]
        restarted = [r for r in window if r["router"] == 0]
        others = [r for r in window if r["router"] != 0]
        rr, ro = rate(restarted), rate(others)
        out[name] = {
            "restarted_hit_rate": rr,
            "others_hit_rate": ro,
            "ratio": rr / ro if rr is not None and ro else None,
            "restarted_requests": len(restarted),
            "others_requests": len(others),
            "restarted_ttft_median_s": statistics.median(r["ttft_s"] for r in restarted) if restarted else None,
            "others_ttft_median_s": statistics.median(r["ttft_s"] for r in others) if others else None,
        }
    return out


def run_variant(model: Path, tmp: Path, name: str, buffer_steps: int, extra: list[str], args: Any) -> dict[str, Any]:
    ports = [pick_free_port_pair() for _ in range(args.replicas)]
    engines: list[Engine] = []
    try:
        for i, port in enumerate(ports):
            config = {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{port}",
                "replay_endpoint": f"tcp://*:{port + 1}",
                "buffer_steps": buffer_steps,
            }
            engines.append(
                start_engine(
                    model,
                    f"e{i}",
                    tmp,
                    SERVED,
                    *("--kv-blocks", str(args.kv_blocks), "--block-size", "16"),
                    *("--kv-events-config", json.dumps(config)),
                )
            )
        settings = tmp / "router-events.yaml"
        index_blocks = max(1, int(args.kv_blocks * 16 * 1.6 / 128))
        settings.write_text(
            json.dumps(
                {
                    "prefix_index_blocks_per_replica": index_blocks,
                    "kv_events_port": 5557,
                    "kv_events_tokenizers": {SERVED: str(model)},
                }
            )
        )
        routers = start_routers(3, engines, ["--strategy", "prefix", *extra], settings, tmp, ports, peer_load=True)
        urls = [u for _, u in routers]
        bodies = tenants(args.seed, args.requests, count=8)
        half = len(bodies) // 2
        rng = random.Random(args.seed)
        try:
            asyncio.run(drive(urls, bodies[:half], rng, args.concurrency, time.monotonic()))
            proc, url = routers[0]
            routers[0] = (restart(proc, url, tmp / "router-0-restarted.log"), url)
            records = asyncio.run(drive(urls, bodies[half:], rng, args.concurrency, time.monotonic()))
        finally:
            for proc, _ in routers:
                proc.terminate()
                proc.wait(30)
    finally:
        for e in engines:
            e.stop()
    result = summarize(records)
    print(name, json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=240, help="per variant; the restart comes halfway")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=256, help="per engine, of 16 tokens")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--variants", default=";".join(VARIANTS), help="separated by ;")
    args = parser.parse_args()
    started = time.monotonic()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = make_tiny_model(tmp / "model", layers=4, hidden=256, vocab=2048)
        for name in args.variants.split(";"):
            buffer_steps, extra = VARIANTS[name]
            results[name] = run_variant(model, tmp, name, buffer_steps, extra, args)
    write(args, results, time.monotonic() - started)


def write(args: Any, results: dict[str, Any], elapsed_s: float) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"settings": {k: str(v) for k, v in vars(args).items()}, "elapsed_s": elapsed_s, "results": results}
    (args.out / "router_restart_real.json").write_text(json.dumps(doc, indent=2) + "\n")

    def f(x: float | None, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        "# A router restarted among three, real engines (`bench/router_restart_real.py`)",
        "",
        f"4 reference engines, 3 routers (KV events, peer load), multi-tenant trace of {args.requests} "
        f"requests, {args.concurrency} at a time, seed {args.seed}; router 0 killed and restarted halfway. "
        "Hit rate: the engines' own cached_tokens / prompt_tokens of the requests each router sent.",
        "",
        "| variant | window after the restart | restarted router | the others | ratio (goal >= 0.97) "
        "| requests (restarted / others) | TTFT median, ms (restarted / others) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for window in ("0-10 s", "10 s on"):
            w = r[window]
            if not w["restarted_requests"] + w["others_requests"]:
                continue  # the trace ended before this window
            ttft_r, ttft_o = w["restarted_ttft_median_s"], w["others_ttft_median_s"]
            rates = f"{f(w['restarted_hit_rate'])} | {f(w['others_hit_rate'])} | {f(w['ratio'], '.2f')}"
            lines.append(
                f"| {name} | {window} | {rates} "
                f"| {w['restarted_requests']} / {w['others_requests']} "
                f"| {f(ttft_r and ttft_r * 1000, '.0f')} / {f(ttft_o and ttft_o * 1000, '.0f')} |"
            )
    lines += ["", f"Took {elapsed_s:.0f} s. JSON: [router_restart_real.json](router_restart_real.json).", ""]
    (args.out / "router_restart_real.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
