"""Cold start of an engine pod: the launcher's phases, with the engine started before the pull ends
or after it, and with engine artifacts cold and warm.

Runs the real launcher (`kvfleet engine launch`, as a process) with the reference engine on CPU
against the real S3 server (SeaweedFS, kvfleet_testkit.seaweedfs), and reports launch-to-first-token
with its phases. Two modes:

``--mode overlap`` (default; docs/benchmarks/cold_start.{json,md,png}): cold starts (empty node
cache, artifacts off) of a sharded random-weight model, with the engine started at once on a folder
the pull fills with verified shards (``--overlap-pull``) and with the engine started after the pull
(``--no-overlap-pull``), alternating run by run (the order flips every repeat); the bare engine
(`kvfleet engine serve` on a complete local copy) and the server's ceiling in the same run.

``--mode artifacts`` (docs/benchmarks/cold_start_artifacts.{json,md,png}), compilation on:

    cold            empty node cache, no artifacts anywhere: weights pulled, artifacts built and pushed
    node-warm       weights on the node, no artifacts (a new engine version on a node that has the model)
    artifacts-warm  weights on the node, artifacts restored from the bucket (first start of that version
                    on this node after another node built them)
    all-warm        weights and artifacts on the node (a restart on the same node)

with the bare engine compiling, warm and eager as baselines. Medians over --repeats, ratios; JSON,
Markdown and a PNG in docs/benchmarks/.

``--mode vllm-load-format`` (docs/benchmarks/cold_start_vllm_load_format.{json,md}): vLLM's CPU
build through the launcher (``engine.kind: vllm``), cold, with ``--vllm-load-format safetensors``
and ``runai_streamer`` on the node cache's verified files, alternating, the order flipping each
repeat; a small model (``--vllm-layers``, ``--vllm-hidden``). vLLM CPU figures, not a GPU's.

    .venv/bin/python bench/cold_start.py [--mode overlap] [--repeats 3] [--layers 6 --hidden 1536 --shards 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.free_port import pick_free_port
from kvfleet.weight_cache import S3Settings, make_client, populate
from kvfleet_testkit.manifests import vllm_cpu_launcher_spec
from kvfleet_testkit.seaweedfs import SeaweedS3, seaweedfs_s3_server

REPO = Path(__file__).resolve().parent.parent

PHASES = ("pull", "artifacts", "engine_start", "first_ready")
SCENARIOS = ("cold", "node-warm", "artifacts-warm", "all-warm")
START_TIMEOUT_S = 600.0


def get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def first_token(port: int) -> None:
    body = json.dumps({"model": "bench", "prompt": "hello", "max_tokens": 1}).encode()
    url = f"http://127.0.0.1:{port}/v1/completions"
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200, response.status


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# Set in main(): the trusted builder's signing key and the public key every launch trusts. Runs that
# push (cold, node-warm) run as the platform's builder; the others as engine pods (public key only).
ARTIFACT_KEYS: dict[str, Path] = {}


def env_for(server: SeaweedS3, node: Path, builder: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if ARTIFACT_KEYS:
        env["KVFLEET_ARTIFACT_KEYS"] = str(ARTIFACT_KEYS["public"])
        if builder:
            env["KVFLEET_ARTIFACT_SIGNING_KEY"] = str(ARTIFACT_KEYS["private"])
    env.update(server.env())
    env["KVFLEET_NODE_CACHE"] = str(node)
    return env


def run_launcher(
    spec: dict[str, Any],
    node: Path,
    server: SeaweedS3,
    work: Path,
    wait_push: bool,
    launch_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One launch: returns the launcher's /coldstart report plus the externally timed wall clock
    (spawn of the launcher process to its first token, which /coldstart's total leaves out)."""
    engine_port, metrics_port = pick_free_port(), pick_free_port()
    spec_path = work / f"spec-{metrics_port}.json"
    spec_path.write_text(json.dumps(spec))
    log = (work / f"launcher-{metrics_port}.log").open("wb")
    argv = [sys.executable, "-m", "kvfleet.cli", "engine", "launch", "--spec", str(spec_path)]
    argv += ["--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port), "--engine-port", str(engine_port)]
    argv += launch_args
    started = time.monotonic()
    env = env_for(server, node, builder=wait_push)
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = started + START_TIMEOUT_S
        report: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            doc = get_json(f"http://127.0.0.1:{metrics_port}/coldstart")
            if doc and doc.get("complete"):
                report = doc
                break
            if process.poll() is not None:
                raise RuntimeError(f"launcher exited {process.returncode}; see {log.name}")
            time.sleep(0.05)
        if report is None:
            raise RuntimeError("launcher did not complete its cold start in time")
        wall = time.monotonic() - started
        while wait_push and not report.get("artifactsPushed"):
            if time.monotonic() > deadline:
                raise RuntimeError("artifacts were never pushed")
            time.sleep(0.2)
            report = get_json(f"http://127.0.0.1:{metrics_port}/coldstart") or report
        report["wallSeconds"] = wall
        return report
    finally:
        stop(process)
        log.close()


def run_bare_engine(model: Path, work: Path, compile_args: list[str], artifacts: Path | None) -> float:
    """`kvfleet engine serve` on a local folder, timed from spawn to its first served token; with
    ``artifacts``, its compile cache is that local directory (warm when an earlier run filled it)."""
    port = pick_free_port()
    log = (work / f"bare-{port}.log").open("wb")
    argv = [sys.executable, "-m", "kvfleet.cli", "engine", "serve", "--model", str(model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--served-model-name", "bench", "--max-model-len", "256", "--device", "cpu"]
    argv += compile_args
    if artifacts is not None:
        argv += ["--artifacts-dir", str(artifacts)]
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        while time.monotonic() - started < START_TIMEOUT_S:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if process.poll() is not None:
                raise RuntimeError(f"bare engine exited {process.returncode}")
            time.sleep(0.05)
        first_token(port)
        return time.monotonic() - started
    finally:
        stop(process)
        log.close()


def s3_ceiling(client: Any, bucket: str, key: str) -> tuple[float, int]:
    """Seconds for one plain GET of ``key`` read to the end: the server's own ceiling."""
    started = time.monotonic()
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    size = 0
    while chunk := body.read(8 << 20):
        size += len(chunk)
    return time.monotonic() - started, size


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def compile_s(report: dict[str, Any]) -> float:
    value = report["phaseDetails"]["engine_start"].get("compileSeconds")
    return float(value) if value is not None else float("nan")


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for scenario, reports in runs.items():
        row: dict[str, Any] = {p: median([r["phases"][p] for r in reports]) for p in PHASES}
        row["compile"] = median([compile_s(r) for r in reports])
        totals = [r["totalSeconds"] for r in reports]
        row.update(
            total=median(totals),
            totalMin=min(totals),
            totalMax=max(totals),
            wall=median([r["wallSeconds"] for r in reports]),
            runs=len(reports),
        )
        out[scenario] = row
    return out


def write_results(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cold_start_artifacts.json").write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    cold, bare = s["cold"]["total"], result["baselines"]["bareEngineSeconds"]["median"]
    lines = [
        "# Cold start by phase: cold vs node-cache-warm vs artifacts-warm",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model: {result['model']['params'] / 1e6:.0f} M parameters, {result['model']['bytes'] / 1e9:.2f} GB of "
        f"float32 safetensors (random weights). Reference engine on CPU, the S3 server on loopback. "
        f"{result['repeats']} runs per scenario; medians in seconds.",
        "",
        "| scenario | pull | artifacts | engine_start | (of which compile) | first_ready | **total** (launch to "
        "first token) | min-max total | vs cold | vs bare engine, warm compile cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SCENARIOS:
        row = s[name]
        lines.append(
            f"| {name} | {row['pull']:.2f} | {row['artifacts']:.2f} | {row['engine_start']:.2f} | "
            f"{row['compile']:.2f} | {row['first_ready']:.2f} | **{row['total']:.2f}** | "
            f"{row['totalMin']:.2f}-{row['totalMax']:.2f} | {row['total'] / cold:.2f}x | {row['total'] / bare:.2f}x |"
        )
    b = result["baselines"]
    nw, aw = s["node-warm"], s["artifacts-warm"]
    restore = aw["artifacts"] + aw["compile"]
    lines += [
        "",
        "Compile time without the artifact vs restore time with it (same weights on the node, medians):",
        "",
        "| | seconds |",
        "|---|---|",
        f"| compile from scratch (node-warm: `compile` column) | {nw['compile']:.2f} |",
        f"| fetch the artifact from the bucket (artifacts-warm: `artifacts` column) | {aw['artifacts']:.2f} |",
        f"| compile from the restored cache (artifacts-warm: `compile` column) | {aw['compile']:.2f} |",
        f"| **restore total (fetch + cached compile)** | **{restore:.2f}** |",
        f"| **ratio compile / restore** | **{nw['compile'] / restore:.2f}x** |",
        f"| artifact size | {result['artifactBytes'] / 1e6:.1f} MB |",
        "",
        f"Launcher decisions (artifacts-warm): {'; '.join(sorted(set(result['decisions'])))}",
    ]
    verify = result.get("nodeCacheCheck") or {}
    if verify:
        lines += [
            "",
            "Node-cache content check inside the warm starts' `pull` (median seconds, mode, bytes hashed): "
            + "; ".join(
                f"{name} {v['seconds']:.2f} s ({v['mode']}, {v['hashedBytes'] / 1e9:.2f} GB)"
                for name, v in verify.items()
            )
            + ". A cold start hashes while it downloads and pays nothing more (docs/benchmarks/node_cache_verify.md).",
        ]
    pull_rate = result["model"]["bytes"] / s["cold"]["pull"] / 1e6
    lines += [
        "",
        "Baselines, same run:",
        "",
        f"- **bare engine, warm compile cache** (`kvfleet engine serve {' '.join(result['compileArgs'])}` on a "
        f"local copy with its compile cache already on local disk, spawn to first token, no launcher): median "
        f"{bare:.2f} s over {len(b['bareEngineSeconds']['runs'])} runs "
        f"(min {min(b['bareEngineSeconds']['runs']):.2f}, max {max(b['bareEngineSeconds']['runs']):.2f}). "
        f"The same engine compiling from scratch: median {b['bareColdCompileSeconds']['median']:.2f} s; eager "
        f"(`--compile off`): median {b['bareEagerSeconds']['median']:.2f} s.",
        f"- **the S3 server's ceiling**: one plain GET of the weights file moves {b['s3CeilingMBps']:.0f} MB/s "
        f"({b['s3CeilingSeconds']:.2f} s for {b['s3CeilingBytes'] / 1e6:.0f} MB). The cold pull ran at "
        f"{pull_rate:.0f} MB/s including manifest, checksums and the node-cache write: "
        f"{pull_rate / b['s3CeilingMBps']:.2f}x the server's ceiling. On real S3 in the same datacenter, "
        "the pull phase scales with that link, not with this loopback server.",
        "",
        "Phases: `pull` weights into the node cache (or find them there); `artifacts` fingerprint and restore "
        "(node directory or bucket); `engine_start` spawn to `/health` 200 (Python and torch import, loading "
        "weights or runtime artifacts); `first_ready` one one-token completion. `total` is their sum; the "
        "launcher process's own start (~1 s of Python imports) is outside it and inside the external `wall` "
        "figure in the JSON.",
        "",
        f"Noise: {result['machine']}. On two cores that other work may share, absolute figures (torch's "
        "import above all, which is most of `engine_start`) move by seconds between runs; compare medians and "
        "ratios, and the min-max column for spread.",
        "",
        "No GPU was available for this run, so there are no CUDA figures; the launcher's CUDA path (device "
        "selection `--device cuda` when `resources.gpus >= 1`, fingerprint with the GPU product) is exercised "
        "by the table tests on CPU only. vLLM was not installed (no GPU machine to run it on).",
        "",
        "![cold start by phase](cold_start_artifacts.png)",
        "",
    ]
    (out_dir / "cold_start_artifacts.md").write_text("\n".join(lines))
    plot_phases(
        s,
        SCENARIOS,
        PHASES,
        (bare, "bare engine"),
        ("seconds (median), launch to first token", "kvfleet launcher cold start by phase (reference engine, CPU)"),
        4,
        out_dir / "cold_start_artifacts.png",
    )


def plot_phases(
    summary: dict[str, dict[str, Any]],
    rows: Sequence[str],
    phases: Sequence[str],
    bare: tuple[float, str],
    labels: tuple[str, str],
    height_in: float,
    path: Path,
) -> None:
    """Stacked bars of each row's median phases, with the bare engine as a dashed line;
    ``bare``: (seconds, legend), ``labels``: (x axis, title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, height_in))
    left = [0.0] * len(rows)
    for phase in phases:
        widths = [summary[r][phase] for r in rows]
        ax.barh(list(rows), widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.axvline(bare[0], color="black", linestyle="--", label=bare[1])
    ax.invert_yaxis()
    ax.set_xlabel(labels[0])
    ax.set_title(labels[1])
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_artifacts_mode(args: argparse.Namespace, server: SeaweedS3, work: Path) -> None:
    from kvfleet.weight_cache.signing import generate_key_pair, public_pem

    ARTIFACT_KEYS["private"] = work / "artifact-signing.pem"
    ARTIFACT_KEYS["public"] = work / "artifact-keys.pem"
    ARTIFACT_KEYS["public"].write_text(public_pem(generate_key_pair(ARTIFACT_KEYS["private"]).public_key()))
    print("building the model ...", flush=True)
    sizes = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "heads": args.heads}
    model = make_tiny_model(work / "model", kv_heads=args.kv_heads, **sizes)
    weights = model / "model.safetensors"
    model_bytes = sum(p.stat().st_size for p in model.iterdir())
    client = client_for(server, work)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    populate(client, model, f"s3://{bucket}/models/bench")
    ceiling_s, ceiling_bytes = s3_ceiling(client, bucket, "models/bench/model.safetensors")

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCENARIOS}
    bare_runs: list[float] = []
    bare_cold_runs: list[float] = []
    bare_eager_runs: list[float] = []
    compile_args = ["--compile", "on", "--compile-mode", args.compile_mode]
    for repeat in range(args.repeats):
        node = work / f"node-{repeat}"

        def spec(prefix: str) -> dict[str, Any]:
            return {
                "name": "bench",
                "servedName": "bench",
                "spec": {
                    "model": {"uri": f"s3://{bucket}/models/bench"},
                    "engine": {"kind": "reference", "maxModelLen": 256, "extraArgs": compile_args},
                    "resources": {"gpus": 0},
                    "cache": {"bucket": bucket, "artifacts": {"enabled": True, "prefix": prefix}},
                },
            }

        # A fresh artifacts prefix per repeat: its cold run misses and pushes, the later ones hit.
        prefix = f"artifacts-{repeat}/"
        print(f"repeat {repeat + 1}/{args.repeats}: cold", flush=True)
        runs["cold"].append(run_launcher(spec(prefix), node, server, work, wait_push=True))
        shutil.rmtree(node / "artifacts")
        print(f"repeat {repeat + 1}/{args.repeats}: node-warm", flush=True)
        runs["node-warm"].append(run_launcher(spec(f"empty-{repeat}/"), node, server, work, wait_push=True))
        shutil.rmtree(node / "artifacts")
        print(f"repeat {repeat + 1}/{args.repeats}: artifacts-warm", flush=True)
        runs["artifacts-warm"].append(run_launcher(spec(prefix), node, server, work, wait_push=False))
        print(f"repeat {repeat + 1}/{args.repeats}: all-warm", flush=True)
        runs["all-warm"].append(run_launcher(spec(prefix), node, server, work, wait_push=False))
        print(f"repeat {repeat + 1}/{args.repeats}: bare engine (cold compile, then warm)", flush=True)
        bare_cache = work / f"bare-cache-{repeat}"
        bare_cold_runs.append(run_bare_engine(model, work, compile_args, bare_cache))
        bare_runs.append(run_bare_engine(model, work, compile_args, bare_cache))
        bare_eager_runs.append(run_bare_engine(model, work, ["--compile", "off"], None))
        for name in SCENARIOS:
            r = runs[name][-1]
            print(
                f"  {name:15s} total {r['totalSeconds']:.2f}s " + " ".join(f"{p}={r['phases'][p]:.2f}" for p in PHASES),
                flush=True,
            )
        print(
            f"  bare engine     warm cache {bare_runs[-1]:.2f}s, cold compile {bare_cold_runs[-1]:.2f}s, "
            f"eager {bare_eager_runs[-1]:.2f}s",
            flush=True,
        )

    checks = {
        "coldPulledFromS3": all(r["phaseDetails"]["pull"]["source"] == "s3" for r in runs["cold"]),
        "warmWeightsFromNode": all(
            r["phaseDetails"]["pull"]["source"] == "node-cache" for s in SCENARIOS[1:] for r in runs[s]
        ),
        "coldArtifactsMissedAndPushed": all(
            r["phaseDetails"]["artifacts"]["source"] == "miss" and r["artifactsPushed"] for r in runs["cold"]
        ),
        "artifactsWarmFromBucket": all(
            r["phaseDetails"]["artifacts"]["source"] == "bucket" for r in runs["artifacts-warm"]
        ),
        "allWarmFromNode": all(r["phaseDetails"]["artifacts"]["source"] == "node-cache" for r in runs["all-warm"]),
        "compiledEveryStart": all(compile_s(r) > 0 for s in SCENARIOS for r in runs[s]),
        "compileCacheHitWhenRestored": all(
            r["phaseDetails"]["engine_start"].get("compileCacheHit")
            for s in ("artifacts-warm", "all-warm")
            for r in runs[s]
        ),
    }
    artifact_sizes = [r["phaseDetails"]["artifacts"].get("sizeBytes", 0) for r in runs["artifacts-warm"]]
    result = {
        "command": "python bench/cold_start.py " + " ".join(sys.argv[1:]),
        "repeats": args.repeats,
        "machine": f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "bytes": model_bytes,
            # float32 weights: four bytes a parameter.
            "params": weights.stat().st_size // 4,
        },
        "checks": checks,
        "summary": summarise(runs),
        "compileArgs": compile_args,
        "artifactBytes": median([float(x) for x in artifact_sizes]),
        "decisions": [r["phaseDetails"]["artifacts"].get("reason", "") for r in runs["artifacts-warm"]],
        "baselines": {
            "bareEngineSeconds": {"median": median(bare_runs), "runs": bare_runs},
            "bareColdCompileSeconds": {"median": median(bare_cold_runs), "runs": bare_cold_runs},
            "bareEagerSeconds": {"median": median(bare_eager_runs), "runs": bare_eager_runs},
            "s3CeilingSeconds": ceiling_s,
            "s3CeilingBytes": ceiling_bytes,
            "s3CeilingMBps": ceiling_bytes / ceiling_s / 1e6,
        },
        "nodeCacheCheck": {
            name: {
                "seconds": median([float(r["phaseDetails"]["pull"].get("verifySeconds", 0.0)) for r in runs[name]]),
                "mode": runs[name][0]["phaseDetails"]["pull"].get("verify"),
                "hashedBytes": runs[name][0]["phaseDetails"]["pull"].get("hashedBytes", 0),
            }
            for name in SCENARIOS[1:]
        },
        "runs": runs,
    }
    write_results(result, args.out)
    print(json.dumps(result["summary"], indent=2))
    print(json.dumps(checks))
    if not all(checks.values()):
        sys.exit("a scenario did not take the cache path it names; see checks")


OVERLAP_MODES = ("overlap", "sequential")
OVERLAP_PHASES = ("pull", "engine_start", "first_ready")


def overlap_spec(bucket: str) -> dict[str, Any]:
    return {
        "name": "bench",
        "servedName": "bench",
        "spec": {
            "model": {"uri": f"s3://{bucket}/models/bench"},
            "engine": {"kind": "reference", "maxModelLen": 256},
            "resources": {"gpus": 0},
        },
    }


def parallel_ceiling(client: Any, bucket: str, keys: list[str]) -> tuple[float, int]:
    """Every shard read at once, one plain GET each, bytes discarded: what the server moves."""
    from concurrent.futures import ThreadPoolExecutor

    def read(key: str) -> int:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        size = 0
        while chunk := body.read(8 << 20):
            size += len(chunk)
        return size

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        total = sum(pool.map(read, keys))
    return time.monotonic() - started, total


VLLM_FORMATS = ("safetensors", "runai_streamer")
VLLM_PHASES = ("pull", "engine_start", "first_ready")


def vllm_spec(bucket: str) -> dict[str, Any]:
    """The vLLM tests' engine (kvfleet_testkit.manifests): CPU, eager, float32, 2 GiB of KV."""
    return vllm_cpu_launcher_spec("bench-vllm", "bench", f"s3://{bucket}/models/bench", bucket)


def run_vllm_load_format_mode(args: argparse.Namespace, server: SeaweedS3, work: Path) -> None:
    """vLLM, cold, launch to first token with each load format; alternating, medians."""
    model = make_tiny_model(
        work / "model",
        layers=args.vllm_layers,
        hidden=args.vllm_hidden,
        heads=max(2, args.vllm_hidden // 64),
        kv_heads=1,
        shards=args.shards,
    )
    model_bytes = sum(p.stat().st_size for p in model.iterdir())
    client = client_for(server, work)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    populate(client, model, f"s3://{bucket}/models/bench")
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in VLLM_FORMATS}
    for repeat in range(args.repeats):
        order = VLLM_FORMATS if repeat % 2 == 0 else tuple(reversed(VLLM_FORMATS))
        for fmt in order:
            node = work / f"node-{fmt}-{repeat}"
            load_before = os.getloadavg()[0]
            report = run_launcher(
                vllm_spec(bucket), node, server, work, wait_push=False, launch_args=("--vllm-load-format", fmt)
            )
            report["loadAverage1m"] = [load_before, os.getloadavg()[0]]
            runs[fmt].append(report)
            shutil.rmtree(node, ignore_errors=True)
            print(
                f"repeat {repeat + 1}/{args.repeats} {fmt:15s} total {report['totalSeconds']:.2f}s "
                + " ".join(f"{p}={report['phases'][p]:.2f}" for p in VLLM_PHASES)
                + f" load {load_before:.1f}",
                flush=True,
            )
    summary = {
        fmt: {
            **{p: median([r["phases"][p] for r in reports]) for p in VLLM_PHASES},
            "total": median([r["totalSeconds"] for r in reports]),
            "totalMin": min(r["totalSeconds"] for r in reports),
            "totalMax": max(r["totalSeconds"] for r in reports),
            "wall": median([r["wallSeconds"] for r in reports]),
            "runs": len(reports),
        }
        for fmt, reports in runs.items()
    }
    loads = [x for m in runs.values() for r in m for x in r["loadAverage1m"]]
    result = {
        "command": "python bench/cold_start.py " + " ".join(sys.argv[1:]),
        "engine": "vLLM's CPU build (vllm-cpu), through the launcher; CPU figures, not a GPU's",
        "repeats": args.repeats,
        "model": {"layers": args.vllm_layers, "hidden": args.vllm_hidden, "shards": args.shards, "bytes": model_bytes},
        "loadAverage1m": {"min": min(loads), "median": median(loads), "max": max(loads)},
        "summary": summary,
        "ratioSafetensorsOverRunai": summary["safetensors"]["total"] / summary["runai_streamer"]["total"],
        "runs": runs,
    }
    write_vllm_load_format_results(result, args.out)
    print(json.dumps(summary, indent=2))


def write_vllm_load_format_results(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cold_start_vllm_load_format.json").write_text(json.dumps(result, indent=2) + "\n")
    s, m, load = result["summary"], result["model"], result["loadAverage1m"]
    lines = [
        "# Cold start with vLLM: `--load-format safetensors` vs `runai_streamer` (vLLM CPU)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"{result['engine']}. Model: {m['bytes'] / 1e6:.0f} MB of float32 safetensors in {m['shards']} shards "
        f"(random weights, {m['layers']} layers, hidden {m['hidden']}), pulled cold from SeaweedFS into an "
        "empty node cache every run; vLLM then reads the node cache's verified files with the load format "
        f"named. The two alternate run by run, the order flipping each repeat; {result['repeats']} runs each; "
        "medians in seconds.",
        "",
        "| load format | pull | engine_start | first_ready | **total** (launch to first token) | min-max total |",
        "|---|---|---|---|---|---|",
    ]
    for fmt in VLLM_FORMATS:
        r = s[fmt]
        lines.append(
            f"| {fmt} | {r['pull']:.2f} | {r['engine_start']:.2f} | {r['first_ready']:.2f} | **{r['total']:.2f}** "
            f"| {r['totalMin']:.2f}-{r['totalMax']:.2f} |"
        )
    lines += [
        "",
        f"**safetensors / runai_streamer: {result['ratioSafetensorsOverRunai']:.2f}x** on the launcher's total "
        "(above 1: runai_streamer started faster).",
        "",
        f"Noise: 2 cores shared with other work; 1-minute load average during the runs {load['min']:.1f}-"
        f"{load['max']:.1f} (median {load['median']:.1f}). On a model this small the weights are a sliver of "
        "vLLM's start (imports, the engine core process, the KV cache), so the formats can only differ by "
        "little here; the streamer's gain is on large models read from fast storage into GPU memory.",
        "",
    ]
    (out_dir / "cold_start_vllm_load_format.md").write_text("\n".join(lines))


def run_overlap_mode(args: argparse.Namespace, server: SeaweedS3, work: Path) -> None:
    print("building the model ...", flush=True)
    sizes = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "heads": args.heads}
    model = make_tiny_model(work / "model", kv_heads=args.kv_heads, shards=args.shards, **sizes)
    model_bytes = sum(p.stat().st_size for p in model.iterdir())
    shard_keys = [f"models/bench/{p.name}" for p in sorted(model.glob("*.safetensors"))]
    client = client_for(server, work)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    print(f"populating {model_bytes / 1e9:.2f} GB ...", flush=True)
    populate(client, model, f"s3://{bucket}/models/bench")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in OVERLAP_MODES}
    bare: list[float] = []
    ceilings: list[float] = []
    for repeat in range(args.repeats):
        # Alternate, flipping the order each repeat, so drift in the machine's load hits both alike.
        order = OVERLAP_MODES if repeat % 2 == 0 else tuple(reversed(OVERLAP_MODES))
        for mode in order:
            node = work / f"node-{mode}-{repeat}"  # an empty node cache: a cold start every time
            flag = "--overlap-pull" if mode == "overlap" else "--no-overlap-pull"
            load_before = os.getloadavg()[0]
            report = run_launcher(overlap_spec(bucket), node, server, work, wait_push=False, launch_args=(flag,))
            report["loadAverage1m"] = [load_before, os.getloadavg()[0]]
            runs[mode].append(report)
            shutil.rmtree(node, ignore_errors=True)
            engine = report["phaseDetails"]["engine_start"]
            print(
                f"repeat {repeat + 1}/{args.repeats} {mode:10s} total {report['totalSeconds']:.2f}s wall "
                f"{report['wallSeconds']:.2f}s "
                + " ".join(f"{p}={report['phases'][p]:.2f}" for p in OVERLAP_PHASES)
                + f" startedBeforePullEnd={engine.get('startedBeforePullEndS', 0):.2f} load {load_before:.1f}",
                flush=True,
            )
        bare.append(run_bare_engine(model, work, ["--compile", "off"], None))
        seconds, moved = parallel_ceiling(client, bucket, shard_keys)
        ceilings.append(moved / seconds / 1e6)
        print(f"  bare engine {bare[-1]:.2f}s; server ceiling {ceilings[-1]:.0f} MB/s", flush=True)

    def row(reports: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {p: median([r["phases"][p] for r in reports]) for p in OVERLAP_PHASES}
        totals = [r["totalSeconds"] for r in reports]
        walls = [r["wallSeconds"] for r in reports]
        out.update(
            total=median(totals),
            totalMin=min(totals),
            totalMax=max(totals),
            wall=median(walls),
            wallMin=min(walls),
            wallMax=max(walls),
            startedBeforePullEnd=median(
                [float(r["phaseDetails"]["engine_start"].get("startedBeforePullEndS", 0.0)) for r in reports]
            ),
            pullMBps=median([model_bytes / r["phases"]["pull"] / 1e6 for r in reports]),
            runs=len(reports),
        )
        return out

    summary = {mode: row(runs[mode]) for mode in OVERLAP_MODES}
    checks = {
        "everyStartPulledFromS3": all(r["phaseDetails"]["pull"]["source"] == "s3" for m in runs.values() for r in m),
        "overlapRunsOverlapped": all(r["phaseDetails"]["engine_start"].get("overlap") is True for r in runs["overlap"]),
        "sequentialRunsDidNot": all(
            r["phaseDetails"]["engine_start"].get("overlap") is False for r in runs["sequential"]
        ),
    }
    loads = [x for m in runs.values() for r in m for x in r["loadAverage1m"]]
    result = {
        "command": "python bench/cold_start.py " + " ".join(sys.argv[1:]),
        "repeats": args.repeats,
        "machine": f"{os.cpu_count()} CPUs shared with other work, {platform.python_implementation()} "
        f"{platform.python_version()}",
        "loadAverage1m": {"min": min(loads), "median": median(loads), "max": max(loads)},
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "shards": args.shards,
            "bytes": model_bytes,
        },
        "server": "SeaweedFS (weed server -s3) on loopback",
        "checks": checks,
        "summary": summary,
        "ratioSequentialOverOverlap": summary["sequential"]["total"] / summary["overlap"]["total"],
        "ratioSequentialOverOverlapWall": summary["sequential"]["wall"] / summary["overlap"]["wall"],
        "baselines": {
            "bareEngineSeconds": {"median": median(bare), "runs": bare},
            "serverCeilingMBps": {"median": median(ceilings), "runs": ceilings},
        },
        "runs": runs,
    }
    write_overlap_results(result, args.out)
    print(json.dumps(summary, indent=2))
    print(json.dumps(checks))
    if not all(checks.values()):
        sys.exit("a run did not take the path it names; see checks")


def write_overlap_results(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cold_start.json").write_text(json.dumps(result, indent=2) + "\n")
    s, b, m = result["summary"], result["baselines"], result["model"]
    load = result["loadAverage1m"]
    lines = [
        "# Cold start: the engine started before the pull ends (overlap) vs after it",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model: {m['bytes'] / 1e9:.2f} GB of float32 safetensors in {m['shards']} shards (random weights, "
        f"{m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}). Reference engine on CPU (eager), "
        f"{result['server']}. Every start is cold (an empty node cache, artifacts off); the two modes "
        f"alternate run by run, the order flipping each repeat; {result['repeats']} runs each; medians in seconds.",
        "",
        "| mode | pull | engine_start (past the pull's end) | first_ready | **total** (launch to first token) "
        "| min-max total | wall (process spawn to first token) | engine started before the pull ended | pull MB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in OVERLAP_MODES:
        r = s[mode]
        lines.append(
            f"| {mode} | {r['pull']:.2f} | {r['engine_start']:.2f} | {r['first_ready']:.2f} | **{r['total']:.2f}** | "
            f"{r['totalMin']:.2f}-{r['totalMax']:.2f} | {r['wall']:.2f} | {r['startedBeforePullEnd']:.2f} | "
            f"{r['pullMBps']:.0f} |"
        )
    lines += [
        "",
        f"**Sequential / overlap: {result['ratioSequentialOverOverlap']:.2f}x** on the launcher's total "
        f"({result['ratioSequentialOverOverlapWall']:.2f}x on the external wall clock).",
        "",
        "Baselines, same run:",
        "",
        f"- **bare engine** (`kvfleet engine serve --compile off` on a complete local copy, spawn to first "
        f"token, no launcher, no pull): median {b['bareEngineSeconds']['median']:.2f} s "
        f"(runs {', '.join(f'{x:.2f}' for x in b['bareEngineSeconds']['runs'])}).",
        f"- **the server's ceiling** (every shard read at once, one plain GET each, bytes discarded): median "
        f"{b['serverCeilingMBps']['median']:.0f} MB/s.",
        "",
        "How to read it: with overlap the engine process starts with the launch, imports torch and waits on the "
        "folder the pull fills (kvfleet.weight_stream); each shard appears there once its sha256 matched, and the "
        "engine loads it while later shards download. `engine_start` is then only the engine's time past the "
        "pull's end (the phases still add up to launch-to-first-token); without overlap it is the whole engine "
        "start. The best overlap can do is max(pull, engine start) instead of their sum.",
        "",
        f"Noise: {result['machine']}; 1-minute load average during the runs {load['min']:.1f}-{load['max']:.1f} "
        f"(median {load['median']:.1f}) on 2 cores, other engineers' builds and tests running beside it. "
        "Absolute seconds move between runs; read the ratio and the min-max column.",
        "",
        "![cold start with and without overlap](cold_start.png)",
        "",
    ]
    (out_dir / "cold_start.md").write_text("\n".join(lines))
    plot_phases(
        s,
        OVERLAP_MODES,
        OVERLAP_PHASES,
        (b["bareEngineSeconds"]["median"], "bare engine (no pull)"),
        (
            "seconds (median), launch to first token, cold node cache",
            "engine started during the pull (overlap) vs after it",
        ),
        3,
        out_dir / "cold_start.png",
    )


def client_for(server: SeaweedS3, work: Path) -> Any:
    creds = work / "creds"
    creds.mkdir(exist_ok=True)
    (creds / "AWS_ACCESS_KEY_ID").write_text(server.access_key)
    (creds / "AWS_SECRET_ACCESS_KEY").write_text(server.secret_key)
    settings = S3Settings(endpoint_url=server.endpoint_url, region=server.region, credentials_dir=creds)
    return make_client(settings, max_pool_connections=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["overlap", "artifacts", "vllm-load-format"], default="overlap")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--shards", type=int, default=4, help="overlap mode: safetensors files of the model")
    parser.add_argument("--compile-mode", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--vllm-layers", type=int, default=4, help="vllm-load-format mode: the model's layers")
    parser.add_argument("--vllm-hidden", type=int, default=512, help="vllm-load-format mode: the model's width")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvfleet-bench-coldstart-"))
    try:
        with seaweedfs_s3_server(work / "seaweedfs") as server:
            if args.mode == "overlap":
                run_overlap_mode(args, server, work)
            elif args.mode == "vllm-load-format":
                run_vllm_load_format_mode(args, server, work)
            else:
                run_artifacts_mode(args, server, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
