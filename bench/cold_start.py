"""Cold start of an engine pod, by phase: cold vs node-cache-warm vs artifacts-warm, compilation on.

Runs the real launcher (`kvfleet engine launch`, as a process) with the reference engine on CPU
against moto's S3 server, for a random-weight model of about 1 GB (flags make it bigger), and
reports launch-to-first-token with its phases:

    cold            empty node cache, no artifacts anywhere: weights pulled, artifacts built and pushed
    node-warm       weights on the node, no artifacts (a new engine version on a node that has the model)
    artifacts-warm  weights on the node, artifacts restored from the bucket (first start of that version
                    on this node after another node built them)
    all-warm        weights and artifacts on the node (a restart on the same node)

Baselines measured in the same run: moto's own ceiling (one plain GET of the weights file, the
fastest this S3 server moves those bytes) and the bare engine (`kvfleet engine serve --compile on`
on a local copy with its compile cache already on local disk, no launcher): what no launcher can go
below; also the bare engine compiling from scratch and the bare engine eager. Results: medians over --repeats,
ratios against cold and against the bare engine; JSON, Markdown and a PNG in docs/benchmarks/.

    .venv/bin/python bench/cold_start.py [--repeats 3] [--layers 6 --hidden 1536 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import logging
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
from pathlib import Path
from typing import Any

from moto.server import ThreadedMotoServer

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.free_port import pick_free_port
from kvfleet.weight_cache import S3Settings, make_client, populate

REPO = Path(__file__).resolve().parent.parent

PHASES = ("pull", "artifacts", "engine_start", "first_ready")
SCENARIOS = ("cold", "node-warm", "artifacts-warm", "all-warm")
ACCESS_KEY, SECRET_KEY = "AKIDBENCH", "bench-secret"
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


def env_for(endpoint: str, node: Path, builder: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if ARTIFACT_KEYS:
        env["KVFLEET_ARTIFACT_KEYS"] = str(ARTIFACT_KEYS["public"])
        if builder:
            env["KVFLEET_ARTIFACT_SIGNING_KEY"] = str(ARTIFACT_KEYS["private"])
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        KVFLEET_NODE_CACHE=str(node),
    )
    return env


def run_launcher(spec: dict[str, Any], node: Path, endpoint: str, work: Path, wait_push: bool) -> dict[str, Any]:
    """One launch: returns the launcher's /coldstart report plus the externally timed wall clock."""
    engine_port, metrics_port = pick_free_port(), pick_free_port()
    spec_path = work / f"spec-{metrics_port}.json"
    spec_path.write_text(json.dumps(spec))
    log = (work / f"launcher-{metrics_port}.log").open("wb")
    argv = [sys.executable, "-m", "kvfleet.cli", "engine", "launch", "--spec", str(spec_path)]
    argv += ["--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port), "--engine-port", str(engine_port)]
    started = time.monotonic()
    env = env_for(endpoint, node, builder=wait_push)
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
    (out_dir / "cold_start.json").write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    cold, bare = s["cold"]["total"], result["baselines"]["bareEngineSeconds"]["median"]
    lines = [
        "# Cold start by phase: cold vs node-cache-warm vs artifacts-warm",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model: {result['model']['params'] / 1e6:.0f} M parameters, {result['model']['bytes'] / 1e9:.2f} GB of "
        f"float32 safetensors (random weights). Reference engine on CPU, moto's S3 server on loopback. "
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
        f"- **moto's ceiling**: one plain GET of the weights file moves {b['s3CeilingMBps']:.0f} MB/s "
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
        "![cold start by phase](cold_start.png)",
        "",
    ]
    (out_dir / "cold_start.md").write_text("\n".join(lines))
    plot(s, bare, out_dir / "cold_start.png")


def plot(summary: dict[str, dict[str, Any]], bare: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    left = [0.0] * len(SCENARIOS)
    for phase in PHASES:
        widths = [summary[s][phase] for s in SCENARIOS]
        ax.barh(list(SCENARIOS), widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.axvline(bare, color="black", linestyle="--", label="bare engine")
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median), launch to first token")
    ax.set_title("kvfleet launcher cold start by phase (reference engine, CPU, moto S3)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--compile-mode", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    work = Path(tempfile.mkdtemp(prefix="kvfleet-bench-coldstart-"))
    from kvfleet.weight_cache.signing import generate_key_pair, public_pem

    ARTIFACT_KEYS["private"] = work / "artifact-signing.pem"
    ARTIFACT_KEYS["public"] = work / "artifact-keys.pem"
    ARTIFACT_KEYS["public"].write_text(public_pem(generate_key_pair(ARTIFACT_KEYS["private"]).public_key()))
    port = pick_free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        print("building the model ...", flush=True)
        sizes = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "heads": args.heads}
        model = make_tiny_model(work / "model", kv_heads=args.kv_heads, **sizes)
        weights = model / "model.safetensors"
        model_bytes = sum(p.stat().st_size for p in model.iterdir())
        creds = work / "creds"
        creds.mkdir()
        (creds / "AWS_ACCESS_KEY_ID").write_text(ACCESS_KEY)
        (creds / "AWS_SECRET_ACCESS_KEY").write_text(SECRET_KEY)
        client = make_client(S3Settings(endpoint_url=endpoint, region="us-east-1", credentials_dir=creds))
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
            runs["cold"].append(run_launcher(spec(prefix), node, endpoint, work, wait_push=True))
            shutil.rmtree(node / "artifacts")
            print(f"repeat {repeat + 1}/{args.repeats}: node-warm", flush=True)
            runs["node-warm"].append(run_launcher(spec(f"empty-{repeat}/"), node, endpoint, work, wait_push=True))
            shutil.rmtree(node / "artifacts")
            print(f"repeat {repeat + 1}/{args.repeats}: artifacts-warm", flush=True)
            runs["artifacts-warm"].append(run_launcher(spec(prefix), node, endpoint, work, wait_push=False))
            print(f"repeat {repeat + 1}/{args.repeats}: all-warm", flush=True)
            runs["all-warm"].append(run_launcher(spec(prefix), node, endpoint, work, wait_push=False))
            print(f"repeat {repeat + 1}/{args.repeats}: bare engine (cold compile, then warm)", flush=True)
            bare_cache = work / f"bare-cache-{repeat}"
            bare_cold_runs.append(run_bare_engine(model, work, compile_args, bare_cache))
            bare_runs.append(run_bare_engine(model, work, compile_args, bare_cache))
            bare_eager_runs.append(run_bare_engine(model, work, ["--compile", "off"], None))
            for name in SCENARIOS:
                r = runs[name][-1]
                print(
                    f"  {name:15s} total {r['totalSeconds']:.2f}s "
                    + " ".join(f"{p}={r['phases'][p]:.2f}" for p in PHASES),
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
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
