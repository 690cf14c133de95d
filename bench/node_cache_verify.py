"""What a node-cache hit's content check costs per GB, against the size-only check it replaced.

One model of several safetensors-sized files is populated to moto's S3 server and pulled once into
a node cache; then, in rotating order and several rounds, the same run times:

    size            the old hit: stat every file and compare its size (the baseline)
    read            read every byte once without hashing: what the engine's loader does next anyway,
                    so the part of a hash that is only I/O
    sha256 x N      the whole hit (pull_model: manifest GET, lock, lease, check) with every file hashed,
                    N = 1, 2, 4 hashing threads (PullSettings.hash_workers)
    stat            the whole hit with verify_on_hit="stat": files whose (inode, size, mtime_ns,
                    ctime_ns) match what the cache recorded when it verified them are not hashed

The files sit in the page cache (they were just written, and each method reads them); a node whose
cache was evicted from memory adds its disk's read time to both `read` and `sha256`.

    .venv/bin/python bench/node_cache_verify.py [--size-gb 2 --files 4 --rounds 3]
        [--cold-start-before B/cold_start.json --cold-start-after A/cold_start.json]

With the two ``bench/cold_start.py --out DIR`` results of the code before and after the content
check, the report also sets their pull phases side by side (where the check costs start time).

Writes docs/benchmarks/node_cache_verify.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfleet.weight_cache import PullSettings, S3Settings, make_client, populate, pull_model
from kvfleet.weight_cache.manifest import Manifest
from kvfleet_testkit.s3_server import moto_s3_server

REPO = Path(__file__).resolve().parent.parent

GB = 10**9
CHUNK = 8 << 20


def write_files(root: Path, total_bytes: int, files: int) -> None:
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    per = total_bytes // files
    block = os.urandom(CHUNK)
    for i in range(files):
        with (root / f"model-{i + 1:05d}-of-{files:05d}.safetensors").open("wb") as f:
            left = per
            while left:
                n = min(left, CHUNK)
                f.write(block[:n])
                left -= n


def size_only(path: Path, manifest: Manifest) -> bool:
    """The hit check before content verification: every file present with the manifest's size."""
    return all((path / e.path).stat().st_size == e.size_bytes for e in manifest.files)


def read_all(path: Path, manifest: Manifest) -> int:
    total = 0
    for entry in manifest.files:
        with (path / entry.path).open("rb") as f:
            while chunk := f.read(CHUNK):
                total += len(chunk)
    return total


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def openssl_speed() -> str | None:
    """OpenSSL's own sha256 figure on this CPU (one core, 16 KiB blocks), as a reference ceiling."""
    try:
        out = subprocess.run(
            ["openssl", "speed", "-seconds", "1", "-bytes", "16384", "sha256"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in out.splitlines() if line.startswith("sha256")]
    return lines[-1] if lines else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--cold-start-before", type=Path, help="cold_start.json of the size-only check")
    parser.add_argument("--cold-start-after", type=Path, help="cold_start.json with the content check")
    args = parser.parse_args()
    cold_start = None
    if args.cold_start_before and args.cold_start_after:
        cold_start = compare_cold_starts(args.cold_start_before, args.cold_start_after)

    work = Path(tempfile.mkdtemp(prefix="kvfleet-bench-verify-"))
    # moto accepts any credentials; boto3's chain must find some.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with moto_s3_server() as endpoint:
        client = make_client(S3Settings(endpoint_url=endpoint, region="us-east-1"))
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        src = work / "src"
        write_files(src, int(args.size_gb * GB), args.files)
        uri = f"s3://{bucket}/models/bench"
        populate(client, src, uri)
        root = work / "node-cache"
        pull = PullSettings(part_size_bytes=1 << 30)  # whole files: moto charges per request
        with pull_model(uri, root, pull, client=client) as first:
            path, manifest = first.path, first.manifest
        total = manifest.total_bytes

        def hit(settings: PullSettings) -> Callable[[], None]:
            def run() -> None:
                with pull_model(uri, root, settings, client=client) as model:
                    assert model.hit and not model.check.reasons, model.check

            return run

        methods: dict[str, Callable[[], Any]] = {
            "size": lambda: size_only(path, manifest),
            "read": lambda: read_all(path, manifest),
            "sha256 x1": hit(pull.model_copy(update={"hash_workers": 1})),
            "sha256 x2": hit(pull.model_copy(update={"hash_workers": 2})),
            "sha256 x4": hit(pull.model_copy(update={"hash_workers": 4})),
            "stat": hit(pull.model_copy(update={"verify_on_hit": "stat"})),
        }
        hit(pull.model_copy(update={"verify_on_hit": "stat"}))()  # records the stat keys once
        read_all(path, manifest)  # page cache warm for every method alike
        samples: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                samples[name].append(timed(methods[name]))
                print(f"round {r + 1}: {name}: {samples[name][-1]:.3f} s", flush=True)

    shutil.rmtree(work, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in samples.items()}
    rows = {
        name: {
            "seconds": v,
            "median_s": med[name],
            "seconds_per_GB": med[name] / (total / GB),
            "GB_per_s": (total / GB) / med[name] if med[name] > 0 else None,
            "vs_size_only_s": med[name] - med["size"],
        }
        for name, v in samples.items()
    }
    result = {
        "command": "python bench/node_cache_verify.py " + " ".join(sys.argv[1:]),
        "model_bytes": total,
        "files": len(manifest.files),
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version()},
        "openssl_speed_sha256": openssl_speed(),
        "methods": rows,
        "cold_start_before_after": cold_start,
    }
    write_reports(result, args.out)
    print(json.dumps({k: round(v["seconds_per_GB"], 4) for k, v in rows.items()}, indent=2))


SCENARIOS = ("cold", "node-warm", "artifacts-warm", "all-warm")


def compare_cold_starts(before_path: Path, after_path: Path) -> dict[str, Any]:
    """The pull phase and total of each cold-start scenario, before and after, and what the check did."""
    before, after = json.loads(before_path.read_text()), json.loads(after_path.read_text())
    rows: dict[str, Any] = {}
    for name in SCENARIOS:
        details = [r["phaseDetails"]["pull"] for r in after["runs"][name]]
        rows[name] = {
            "pull_before_s": before["summary"][name]["pull"],
            "pull_after_s": after["summary"][name]["pull"],
            "total_before_s": before["summary"][name]["total"],
            "total_after_s": after["summary"][name]["total"],
            "verify_seconds": statistics.median(d.get("verifySeconds", 0.0) for d in details),
            "hashed_bytes": details[0].get("hashedBytes", 0),
        }
    return {
        "commands": [before["command"], after["command"]],
        "model_bytes": after["model"]["bytes"],
        "repeats": [before["repeats"], after["repeats"]],
        "scenarios": rows,
    }


def write_reports(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "node_cache_verify.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["methods"]
    lines = [
        "# Node-cache hit: content check cost per GB",
        "",
        f"Command: `{result['command']}`. Model: {result['model_bytes'] / GB:.2f} GB in {result['files']} files, "
        f"in the page cache. {result['rounds']} rounds, rotating order; medians. Machine: "
        f"{result['machine']['cpus']} CPUs ({result['machine']['cpu']}), shared with other work.",
        "",
        "| check | median s | s per GB | GB/s | added to a hit vs size-only (s) |",
        "|---|---|---|---|---|",
    ]
    for name, row in m.items():
        rate = f"{row['GB_per_s']:.2f}" if row["GB_per_s"] is not None else "-"
        lines.append(
            f"| {name} | {row['median_s']:.3f} | {row['seconds_per_GB']:.3f} | {rate} | {row['vs_size_only_s']:.3f} |"
        )
    lines += [
        "",
        "`size` is the baseline (the check before content verification); `read` reads every byte without "
        "hashing, the I/O part of a hash that the engine's loader pays next anyway (and, after a hash, finds in the "
        "page cache). `sha256 xN` and `stat` are whole hits through `pull_model` (manifest GET from moto, lock, "
        "lease, check).",
    ]
    cs = result.get("cold_start_before_after")
    if cs:
        lines += [
            "",
            f"## Cold start before and after (`bench/cold_start.py`, {cs['model_bytes'] / GB:.2f} GB model "
            f"in one file, {cs['repeats'][0]} and {cs['repeats'][1]} run(s) per scenario)",
            "",
            "| scenario | pull before (size-only) s | pull after (sha256) s | of which the content check s | "
            "bytes hashed | total before s | total after s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in cs["scenarios"].items():
            lines.append(
                f"| {name} | {row['pull_before_s']:.2f} | {row['pull_after_s']:.2f} | {row['verify_seconds']:.2f} | "
                f"{row['hashed_bytes'] / GB:.2f} GB | {row['total_before_s']:.2f} | {row['total_after_s']:.2f} |"
            )
        lines += [
            "",
            "The two runs are separate runs of the whole benchmark on a 2-core machine shared with other work: "
            "`engine_start` (torch's import and compile) moved by tens of seconds between them, so the totals are "
            "not comparable; the pull phase and the check's own seconds (from the launcher's phase detail) are. "
            "A cold start hashes while it downloads, as before, so it pays nothing more; a warm start's model is "
            "one 1 GB file here, hashed by one thread.",
        ]
    if result.get("openssl_speed_sha256"):
        lines += ["", f"OpenSSL's sha256 on one core of this CPU (`openssl speed`): `{result['openssl_speed_sha256']}`"]
    lines.append("")
    (out / "node_cache_verify.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
