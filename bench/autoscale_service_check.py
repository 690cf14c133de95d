"""Check the simulator's service model against the reference engine's measured behaviour.

1. Start ``kvfleet engine serve`` (CPU) on a tiny random-weight model.
2. Fit the model's three parameters from isolated measurements: the decode step time at batch 1
   and batch 8 (``t0 + k x batch``) and the prefill rate (one long prompt, one output token).
3. Run an open-loop Poisson load against the engine, replay the same arrivals, prompt and output
   lengths through the simulator's ``Cluster`` with the fitted parameters, and report the error of
   the predicted TTFT and end-to-end latency (medians, p90).

Run: ``python bench/autoscale_service_check.py`` (about a minute). Results go to
docs/benchmarks/autoscaler_service_check.json and are quoted in docs/benchmarks/autoscaler.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoscale_sim import Cluster, ServiceModel, SimConfig

from kvfleet.free_port import pick_free_port

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"


async def one(http: aiohttp.ClientSession, url: str, prompt: list[int], out: int) -> tuple[float, float]:
    """(TTFT, end-to-end) of one streamed completion."""
    start = time.perf_counter()
    first = None
    body = {"model": "tiny", "prompt": prompt, "max_tokens": out, "ignore_eos": True, "stream": True}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data:") and b"[DONE]" not in line and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


async def measure(url: str, rng: np.random.Generator, args: argparse.Namespace) -> dict[str, object]:
    async with aiohttp.ClientSession() as http:
        await one(http, url, [5] * 8, 4)  # warm up
        # Decode step time at batch 1 and 8: ITL from long outputs with short prompts.
        itl = {}
        for batch in (1, 8):
            results = await asyncio.gather(*(one(http, url, [7] * 8, 64) for _ in range(batch)))
            itl[batch] = float(np.median([(e2e - ttft) / 63 for ttft, e2e in results]))
        k = max((itl[8] - itl[1]) / 7, 0.0)
        t0 = max(itl[1] - k, 1e-4)
        # Prefill: one long prompt, one token out, minus one step.
        ttfts = [(await one(http, url, [11] * args.long_prompt, 1))[0] for _ in range(3)]
        prefill_rate = args.long_prompt / max(float(np.median(ttfts)) - t0, 1e-4)
        # Open-loop Poisson load.
        n = args.requests
        gaps = rng.exponential(1.0 / args.rate, n)
        arrivals = np.cumsum(gaps) - gaps[0]
        prompts = rng.integers(16, 160, n)
        outputs = rng.integers(8, 48, n)
        t_start = time.perf_counter()

        async def at(i: int) -> tuple[float, float]:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t_start)))
            return await one(http, url, [int(x) for x in rng.integers(10, 900, int(prompts[i]))], int(outputs[i]))

        measured = await asyncio.gather(*(at(i) for i in range(n)))
    return {
        "t0": t0,
        "k": k,
        "prefill": prefill_rate,
        "arrivals": arrivals,
        "prompts": prompts,
        "outputs": outputs,
        "measured": np.asarray(measured),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--long-prompt", type=int, default=400)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    model = WORK / "tiny-check"
    kvfleet = [sys.executable, "-m", "kvfleet.cli"]
    if not model.exists():
        subprocess.run(
            [*kvfleet, "engine", "make-tiny-model", str(model), "--layers", "4", "--hidden", "128"], check=True
        )
    port = pick_free_port()
    engine = subprocess.Popen(
        [
            *kvfleet,
            "engine",
            "serve",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.batched_tokens),
            "--no-enable-prefix-caching",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                import urllib.request

                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if engine.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("engine did not become healthy")
            time.sleep(0.2)
        m = asyncio.run(measure(url, np.random.default_rng(args.seed), args))
    finally:
        engine.terminate()
        engine.wait(timeout=30)

    fitted = ServiceModel(
        step_base_s=float(m["t0"]),  # type: ignore[arg-type]
        step_per_seq_s=float(m["k"]),  # type: ignore[arg-type]
        prefill_tokens_per_s=float(m["prefill"]),  # type: ignore[arg-type]
        max_batched_tokens=args.batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_capacity_tokens=10**9,
    )
    cfg = SimConfig(dt_s=0.01, timeout_s=1e9)
    arr = np.asarray(m["arrivals"])
    prompts, outputs = np.asarray(m["prompts"]), np.asarray(m["outputs"])
    sim_ttft, sim_e2e = simulate(fitted, cfg, arr, prompts, outputs)
    measured = np.asarray(m["measured"])
    report = {
        "command": "python bench/autoscale_service_check.py " + " ".join(sys.argv[1:]),
        "fitted": {
            "step_base_s": fitted.step_base_s,
            "step_per_seq_s": fitted.step_per_seq_s,
            "prefill_tokens_per_s": fitted.prefill_tokens_per_s,
        },
        "requests": len(arr),
        "rate_rps": args.rate,
        "measured": {
            "ttft_p50_s": float(np.median(measured[:, 0])),
            "ttft_p90_s": float(np.percentile(measured[:, 0], 90)),
            "e2e_p50_s": float(np.median(measured[:, 1])),
            "e2e_p90_s": float(np.percentile(measured[:, 1], 90)),
        },
        "simulated": {
            "ttft_p50_s": float(np.nanmedian(sim_ttft)),
            "ttft_p90_s": float(np.nanpercentile(sim_ttft, 90)),
            "e2e_p50_s": float(np.median(sim_e2e)),
            "e2e_p90_s": float(np.percentile(sim_e2e, 90)),
        },
    }
    report["relative_error"] = {
        key: (report["simulated"][key] - report["measured"][key]) / report["measured"][key]  # type: ignore[index]
        for key in report["measured"]  # type: ignore[union-attr]
    }
    out = ROOT / "docs" / "benchmarks" / "autoscaler_service_check.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


def simulate(
    model: ServiceModel, cfg: SimConfig, arr: np.ndarray, prompts: np.ndarray, outputs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT, end-to-end) per request in the simulator, one always-ready replica."""
    cluster = Cluster(arr, prompts, outputs, model, cfg)
    cluster.scale_to(1, -1e9)
    done_at = np.full(len(arr), np.nan)
    s = 0
    while np.isnan(done_at).any() and s < 10**6:
        now = s * cfg.dt_s
        cluster.step(now)
        newly = (cluster.state == 4) & np.isnan(done_at)
        done_at[newly] = now + cfg.dt_s
        s += 1
    return cluster.first_tok - arr, done_at - arr


if __name__ == "__main__":
    raise SystemExit(main())
