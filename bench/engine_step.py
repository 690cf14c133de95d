"""What one decode step of the reference engine costs, through its own ``core.step()``.

  host-loop  CPU: a 1-layer, hidden-64 model, so the figure is the engine's host loop
             (scheduling, input building, sampling, outputs), not its matmuls; at batch 1 and
             32. With --baseline-python, the same measurement also runs under another
             interpreter (a checkout of the engine before a change), alternating run by run.
  profile    CUDA: torch.profiler over steady decode steps at batch 1 and 32: wall time per step
             against GPU busy time per step (the union of the kernels' intervals), the card named;
             --compare-async also runs the same engine with overlapped steps off, in the same
             process, --compare-graphs with CUDA graphs off, and --compare-decode-attention with
             decode attention by gather + SDPA instead of the Triton paged kernel.

  kernel     CUDA: decode attention alone, the Triton paged kernel against gather + SDPA, at
             batch 1 and 32 and two context lengths, each method replayed from a CUDA graph of
             16 calls (one per layer), alternating; the card named.

All merge their figures into docs/benchmarks/engine.json under "step" and re-render engine.md
(bench/engine_throughput.py --render-only).

    .venv/bin/python bench/engine_step.py host-loop --baseline-python /path/to/old/.venv/bin/python
    python bench/engine_step.py profile --layers 16 --hidden 2048 --prompt-tokens 512
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.engine_core import EngineCore, load_engine_core
from kvfleet.engine.request import EngineRequest
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.settings import EngineSettings
from kvfleet.engine.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "docs" / "benchmarks"


def steady_decode(core: EngineCore, batch: int, prompt_tokens: int, new_tokens: int, vocab: int, tag: str) -> None:
    """Admit ``batch`` requests and step until each has its first token: later steps are decodes."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(7919 * (i + 1) + 31 * j) % (vocab - 300) + 300 for j in range(prompt_tokens)]
        core.add_request(EngineRequest(f"{tag}-{i}", prompt, params, time.monotonic()))
    started: set[str] = set()
    while len(started) < batch:
        for out in core.step():
            started.add(out.request_id)


def drain(core: EngineCore) -> None:
    for request_id in list(core._requests):
        core.abort(request_id)


def time_steps(core: EngineCore, steps: int, cpu: list[float] | None = None) -> list[float]:
    """Wall time of each step; with ``cpu``, also this thread's CPU time of each step (with one
    torch thread that is all of the step's work, and it barely moves when others load the machine)."""
    times = []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        core.step()
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
    return times


def host_loop_once(args: argparse.Namespace) -> dict[str, float]:
    """Median core.step() of a decode at each batch size, on CPU, one torch thread."""
    torch.set_num_threads(1)
    model_dir = args.work_dir / "llama-1x64-v1024"
    if not (model_dir / "model.safetensors").exists():
        make_tiny_model(model_dir, overwrite=True, layers=1, hidden=64, vocab=1024)
    settings = EngineSettings(device="cpu", num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=512)
    core = load_engine_core(model_dir, settings, "bench")
    out = {}
    for batch in (1, 32):
        steady_decode(core, batch, args.prompt_tokens, args.steps + 20, 1024, f"b{batch}")
        time_steps(core, 10)
        cpu: list[float] = []
        out[f"decode_step_s@{batch}"] = statistics.median(time_steps(core, args.steps, cpu))
        out[f"decode_step_cpu_s@{batch}"] = statistics.median(cpu)
        drain(core)
    return out


def host_loop(args: argparse.Namespace) -> dict[str, Any]:
    interpreters = {"kvfleet": sys.executable}
    if args.baseline_python:
        interpreters["baseline"] = args.baseline_python
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in interpreters}
    for _ in range(args.repeats):
        for name, python in interpreters.items():
            # A fresh process per run: the child measures, prints one JSON line.
            argv = [python, __file__, "host-loop-child", "--steps", str(args.steps)]
            argv += ["--prompt-tokens", str(args.prompt_tokens), "--work-dir", str(args.work_dir)]
            # The baseline imports its own checkout's engine: no PYTHONPATH of ours leaks into it.
            env = {k: v for k, v in os.environ.items() if name == "kvfleet" or k != "PYTHONPATH"}
            run = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
            line = run.stdout.strip().splitlines()[-1]
            samples[name].append(json.loads(line))
            print(f"[host-loop] {name}: {line}", flush=True)
    medians = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for name, runs in samples.items()}
    return {
        "device": "cpu",
        "model": "1 layer, hidden 64, vocab 1024, float32, 1 torch thread",
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "repeats": args.repeats,
        "baseline_python": args.baseline_python or None,
        **({"baseline_note": args.baseline_note} if args.baseline_note else {}),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "medians": medians,
        "samples": samples,
    }


def gpu_busy_s(prof: Any) -> float:
    """Union of the device kernels' and copies' intervals, in seconds."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in intervals:
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        busy += cur_end - cur_start
    return busy * 1e-6  # profiler times are microseconds


def profile(args: argparse.Namespace) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    model_dir = args.work_dir / f"llama-{args.layers}x{args.hidden}-v{args.vocab}"
    if not (model_dir / "model.safetensors").exists():
        make_tiny_model(
            model_dir, overwrite=True, layers=args.layers, hidden=args.hidden, vocab=args.vocab,
            heads=8, kv_heads=4, max_position_embeddings=2048,
        )  # fmt: skip
    results: dict[str, Any] = {
        "device": f"cuda ({torch.cuda.get_device_name()})" if args.device == "cuda" else "cpu (dry run)",
        "model": f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, bfloat16 random weights",
        "prompt_tokens": args.prompt_tokens,
        "runs": {},
    }
    configs = [(True, "auto", "auto")]  # the defaults: graphs on, overlapped steps and the kernel on CUDA
    if args.compare_async:
        configs.append((True, "off", "auto"))
    if args.compare_graphs:
        configs.append((False, "auto", "auto"))
    if args.compare_decode_attention:
        configs.append((True, "auto", "gather"))
    cores: dict[str, EngineCore] = {}
    for graphs, async_scheduling, decode_attention in configs:
        settings = EngineSettings(
            device=args.device,  # type: ignore[arg-type]
            num_kv_blocks=4096,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            compile=args.compile,  # type: ignore[arg-type]
            cuda_graphs=graphs,
            async_scheduling=async_scheduling,  # type: ignore[arg-type]
            decode_attention=decode_attention,  # type: ignore[arg-type]
            artifacts_dir=args.artifacts_dir,
        )
        core = load_engine_core(model_dir, settings, "bench")
        overlap = "on" if core.overlap else "off"
        decode = "triton" if core.runner.model.decode_attention_triton else "gather"
        cores[f"graphs={'on' if graphs else 'off'} compile={args.compile} overlap={overlap} decode={decode}"] = core
    # Every engine is loaded once; the runs alternate between them, so a drift of the machine
    # (clocks, other tenants) hits each alike.
    samples: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        for batch in (1, 32):
            for name, core in cores.items():
                steady_decode(core, batch, args.prompt_tokens, 400, args.vocab, f"r{rep}b{batch}")
                time_steps(core, 10)  # any bucket met for the first time is captured here
                wall = statistics.median(time_steps(core, args.steps))
                sync()
                n = 10
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    t0 = time.perf_counter()
                    for _ in range(n):
                        core.step()
                    sync()
                    profiled_wall = (time.perf_counter() - t0) / n
                busy = gpu_busy_s(prof) / n
                row = {
                    "decode_step_wall_s": wall,
                    "profiled_step_wall_s": profiled_wall,
                    "gpu_busy_s": busy,
                    "wall_over_busy": wall / busy if busy else None,
                    "overlapped": core.overlap,
                    "uniform_steps": core.runner.uniform_steps,
                    "graphs": [str(s) for s in core.runner.graphs.shapes] if core.runner.graphs else [],
                    "graphs_disabled": core.runner.graphs.disabled_reason if core.runner.graphs else None,
                }
                samples.setdefault(f"{name}@{batch}", []).append(row)
                print(f"[profile] run {rep + 1} {name} batch {batch}: {json.dumps(row)}", flush=True)
                if args.trace_dir and rep == 0 and name == next(iter(cores)) and batch == 32:
                    prof.export_chrome_trace(str(args.trace_dir / "decode_step_b32.json"))
                drain(core)
                while core.has_work():
                    core.step()  # collects a step still in flight
    for key, rows in samples.items():
        row = dict(rows[-1])
        for field in ("decode_step_wall_s", "profiled_step_wall_s", "gpu_busy_s"):
            row[field] = statistics.median(r[field] for r in rows)
        ratios = [r["wall_over_busy"] for r in rows if r["wall_over_busy"] is not None]
        row["wall_over_busy"] = statistics.median(ratios) if ratios else None
        row["wall_over_busy_samples"] = ratios
        results["runs"][key] = row
    results["repeats"] = args.repeats
    return results


def kernel_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Decode attention alone: the Triton kernel against gather + SDPA, same inputs, CUDA graphs."""
    import numpy as np

    from kvfleet.engine.block_table_attention import (
        UniformBatch,
        UniformChunk,
        block_table_attention,
        causal_mask,
        flat_len,
        pack_uniform,
    )
    from kvfleet.engine.model import _triton_decode
    from kvfleet.engine.step_shapes import StepShape, width_bucket

    kv_heads, group, dim, bs, layers = 4, 2, 256, 16, 16  # the profiled model's attention
    dev = torch.device("cuda")
    rows: dict[str, Any] = {}
    for batch in (1, 32):
        for ctx in (576, 2048):
            width = width_bucket(-(-ctx // bs), 128)  # ctx: keys per sequence, the query's included
            blocks = batch * width
            shape = StepShape(batch=batch, query=1, width_blocks=width)
            flat = np.zeros(flat_len(shape), dtype=np.int64)
            perm = torch.randperm(blocks).tolist()
            chunks = [UniformChunk([0], ctx - 1, perm[i * width : (i + 1) * width]) for i in range(batch)]
            pack_uniform(shape, chunks, bs, blocks, flat)
            ub = UniformBatch.from_flat(shape, torch.from_numpy(flat).to(dev))
            kp = torch.randn((blocks + 1) * bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
            vp = torch.randn_like(kp)
            q = torch.randn(batch, kv_heads * group, dim, device=dev, dtype=torch.bfloat16)
            k = torch.randn(batch, kv_heads, dim, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            mask = causal_mask(ub, group, bs)
            methods = {
                "gather+sdpa": functools.partial(block_table_attention, q, k, v, kp, vp, ub, bs, mask),
                "triton": functools.partial(_triton_decode, q, k, v, kp, vp, ub, bs),
            }
            diff = (methods["triton"]().float() - methods["gather+sdpa"]().float()).abs().max().item()
            graphs = {}
            for name, fn in methods.items():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(layers):
                        fn()
                graphs[name] = g
            samples: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(args.repeats):
                for name, g in graphs.items():
                    g.replay()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(20):
                        g.replay()
                    end.record()
                    end.synchronize()
                    samples[name].append(start.elapsed_time(end) * 1e-3 / (20 * layers))
            kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
            row: dict[str, Any] = {"max_abs_diff": diff, "width_blocks": width, "kv_bytes_per_call": kv_bytes}
            for name, times in samples.items():
                row[f"{name}_s"] = statistics.median(times)
                row[f"{name}_samples_s"] = times
            row["speedup"] = row["gather+sdpa_s"] / row["triton_s"]
            row["triton_kv_tb_per_s"] = kv_bytes / row["triton_s"] / 1e12
            rows[f"batch={batch} ctx={ctx}"] = row
            print(f"[kernel] batch {batch} ctx {ctx}: {json.dumps(row)}", flush=True)
    return {
        "device": f"cuda ({torch.cuda.get_device_name()})",
        "shape": f"{kv_heads} KV heads x {group} query heads each, head_dim {dim}, block {bs}, bfloat16; "
        f"one decode query per sequence; each graph holds {layers} calls (K/V write + attention)",
        "repeats": args.repeats,
        "runs": rows,
    }


def merge(key: str, value: dict[str, Any], out_dir: Path) -> None:
    path = out_dir / "engine.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("step", {})[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")
    if data.get("devices"):
        throughput = [sys.executable, str(REPO / "bench" / "engine_throughput.py"), "--render-only"]
        subprocess.run([*throughput, "--out-dir", str(out_dir)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["host-loop", "host-loop-child", "profile", "kernel"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--baseline-python", default="")
    parser.add_argument("--baseline-note", default="", help="what the baseline checkout is, for engine.md")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="profile: cpu is a dry run")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--compare-graphs", action="store_true", help="profile also with CUDA graphs off")
    parser.add_argument(
        "--compare-async", action="store_true", help="profile also with overlapped steps off (--async-scheduling off)"
    )
    parser.add_argument(
        "--compare-decode-attention",
        action="store_true",
        help="profile also with decode attention by gather + SDPA (--decode-attention gather)",
    )
    parser.add_argument("--artifacts-dir", type=Path, default=None, help="compile cache shared across runs")
    parser.add_argument("--trace-dir", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvfleet-bench")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--no-merge", action="store_true")
    parser.add_argument("--merge-key", default="", help="the key under engine.json's step (default: per mode)")
    args = parser.parse_args()
    if args.mode == "host-loop-child":
        print(json.dumps(host_loop_once(args)))
        return 0
    modes = {"host-loop": (host_loop, "host_loop"), "profile": (profile, "cuda_profile"), "kernel": (kernel_bench, "")}
    run, key = modes[args.mode]
    result = run(args)
    print(json.dumps(result, indent=2))
    if not args.no_merge:
        merge(args.merge_key or key or "paged_decode_kernel", result, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
