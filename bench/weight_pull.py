"""Weight-pull benchmark: kvfleet's pull vs boto3 and the AWS CLI on one loopback S3 server.

The baselines are boto3's default (download_file per file), boto3's TransferManager tuned the way
a careful user would (every file submitted at once, 16 threads, 32 MiB parts; and with parts as
large as the largest file, the fastest request shape on this server), and `aws s3 cp --recursive`.
The report sets kvfleet against the best of them, not only the default.

Every method downloads the same multi-file model from the same moto server (run as its own
process, so the client's and the server's Python do not share a GIL), in the same run, in
rotating order, several times; the report gives medians and ratios. The server's own ceiling is
measured too (raw parallel ranged GETs that read and discard the bytes: no hashing, no disk), so
the table says which part of a figure is the server's.

    .venv/bin/python bench/weight_pull.py                    # the committed run: 2 GB, 3 rounds
                                                             # (~17 min on 2 shared cores, mostly the
                                                             # boto3 and AWS CLI baselines on moto)
    .venv/bin/python bench/weight_pull.py --size-gb 0.5 --rounds 2   # a quick look

Writes docs/benchmarks/weight_cache.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from kvfleet.free_port import pick_free_port
from kvfleet.weight_cache import NodeCacheSettings, PopulateSettings, PullSettings, S3Settings, make_client, populate
from kvfleet.weight_cache.download import pull_to_dir
from kvfleet.weight_cache.parts import plan_parts
from kvfleet.weight_cache.pull import pull_model
from kvfleet.weight_cache.s3 import S3Uri

MB = 1000 * 1000
MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "benchmarks"
BUCKET = "bench-weights"
PREFIX = "models/bench"
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def make_model(root: Path, total_bytes: int, files: int) -> dict[str, int]:
    """``files`` safetensors shards sharing ``total_bytes`` (the last one smaller, as real shards
    are), plus config and tokenizer files. Random bytes, so nothing compresses."""
    sizes: dict[str, int] = {}
    shard = -(-total_bytes // files)
    left = total_bytes
    for i in range(files):
        size = min(shard, left) if i < files - 1 else left
        sizes[f"model-{i + 1:05d}-of-{files:05d}.safetensors"] = size
        left -= size
    sizes["config.json"] = 700
    sizes["tokenizer.json"] = 2 * MiB
    sizes["generation_config.json"] = 120
    chunk = os.urandom(64 * MiB)  # one random block, rotated per file: fast to write, still incompressible
    for i, (name, size) in enumerate(sizes.items()):
        with (root / name).open("wb") as f:
            written = 0
            offset = (i * 7919) % len(chunk)
            block = chunk[offset:] + chunk[:offset]
            while written < size:
                n = min(len(block), size - written)
                f.write(block[:n])
                written += n
    return sizes


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def raw_ranged_gets(endpoint: str, keys: dict[str, int], part_bytes: int, concurrency: int) -> None:
    """The server's ceiling at kvfleet's part size and concurrency: GET every range, discard it."""
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=concurrency))
    jobs = [(key, part) for key, size in keys.items() for part in plan_parts(size, part_bytes)]

    def get(job: tuple[str, Any]) -> int:
        key, part = job
        return len(client.get_object(Bucket=BUCKET, Key=key, Range=part.http_range)["Body"].read())

    with ThreadPoolExecutor(concurrency) as pool:
        assert sum(pool.map(get, jobs)) == sum(keys.values())


def raw_whole_gets(endpoint: str, keys: dict[str, int], concurrency: int) -> None:
    """The other shape of the server's ceiling: one plain GET per file (files in parallel)."""
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=concurrency))

    def get(key: str) -> int:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        total = 0
        while chunk := body.read(8 * MiB):
            total += len(chunk)
        return total

    with ThreadPoolExecutor(concurrency) as pool:
        assert sum(pool.map(get, keys)) == sum(keys.values())


def boto3_download_file(endpoint: str, keys: dict[str, int], dest: Path) -> None:
    """What a script usually does: download_file per file, default TransferConfig."""
    client = boto3.client("s3", endpoint_url=endpoint)
    for key in keys:
        target = dest / key.rsplit("/", 1)[1]
        client.download_file(BUCKET, key, str(target))


def boto3_transfer_manager(endpoint: str, keys: dict[str, int], dest: Path, threads: int, part_bytes: int) -> None:
    """boto3 tuned: one TransferManager, every file submitted at once (files download concurrently),
    ``threads`` workers and connections, ``part_bytes`` ranges (a file at or below it is one GET)."""
    from boto3.s3.transfer import TransferConfig
    from s3transfer.manager import TransferManager

    # Twice the threads: the manager's own requests (HEAD per file) must not evict a worker's connection.
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=2 * threads))
    config = TransferConfig(
        multipart_threshold=part_bytes,
        multipart_chunksize=part_bytes,
        max_concurrency=threads,
        max_io_queue=1000,
        io_chunksize=1 * MiB,
    )
    with TransferManager(client, config) as manager:
        futures = [manager.download(BUCKET, key, str(dest / key.rsplit("/", 1)[1])) for key in keys]
        for future in futures:
            future.result()


def aws_cli_cp(aws: str, endpoint: str, dest: Path) -> None:
    env = {**os.environ, **CREDS}
    source = f"s3://{BUCKET}/{PREFIX}/"
    subprocess.run(
        [aws, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", endpoint, *[source, str(dest)]],
        check=True,
        env=env,
    )


def cat_files(paths: list[Path]) -> None:
    subprocess.run(["cat", *map(str, paths)], check=True, stdout=subprocess.DEVNULL)


def read_files(paths: list[Path]) -> None:
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.read(8 * MiB):
                pass


def find_aws(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "aws"
    return str(beside) if beside.exists() else shutil.which("aws")


def disk_write_fsync(dest: Path, sizes: dict[str, int]) -> None:
    """The disk's ceiling for what kvfleet must do: write the same bytes and fsync each file."""
    block = os.urandom(8 * MiB)
    for name, size in sizes.items():
        fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left:
                left -= os.write(fd, block[: min(len(block), left)])
            os.fsync(fd)
        finally:
            os.close(fd)


BOTO3 = "boto3 download_file per file (default TransferConfig)"
TUNED_THREADS = 16
TUNED_PART = 32 * MiB
BOTO3_TUNED = f"boto3 TransferManager tuned (all files at once, {TUNED_THREADS} threads, 32 MiB parts)"
BOTO3_TUNED_WHOLE = f"boto3 TransferManager tuned (all files at once, {TUNED_THREADS} threads, part >= largest file)"
AWSCLI = "aws s3 cp --recursive"
KV_DEFAULT = "kvfleet pull (defaults)"
KV_WHOLE = "kvfleet pull (part size >= largest file)"
KV_WHOLE_NOSYNC = "kvfleet pull (part size >= largest file, no fsync)"
KV_WHOLE_16 = "kvfleet pull (part size >= largest file, 16 in flight: tuned boto3's threads)"
CEIL_RANGED = "server ceiling: raw ranged GETs at kvfleet's default part size"
CEIL_WHOLE = "server ceiling: one raw GET per file"
DISK = "disk ceiling: write + fsync the same bytes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="model size in GB (10^9 bytes)")
    parser.add_argument("--files", type=int, default=8, help="safetensors shards")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of every method (medians reported)")
    parser.add_argument("--aws-cli", help="aws executable (default: next to this Python, then PATH)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--tmp", type=Path, default=None, help="scratch directory (default: system temp)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md/.png from the .json in --out")
    args = parser.parse_args()
    if args.report_only:
        write_reports(json.loads((args.out / "weight_cache.json").read_text()), args.out)
        return
    logging.basicConfig(level=logging.WARNING)

    for name, value in CREDS.items():
        os.environ[name] = value
    port = pick_free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = start_moto(port)
    scratch = Path(tempfile.mkdtemp(prefix="kvfleet-bench-", dir=args.tmp))
    aws = find_aws(args.aws_cli)
    try:
        client = make_client(S3Settings(endpoint_url=endpoint), max_pool_connections=8)
        client.create_bucket(Bucket=BUCKET)
        src = scratch / "src"
        src.mkdir()
        sizes = make_model(src, int(args.size_gb * 1e9), args.files)
        total = sum(sizes.values())
        print(f"model: {len(sizes)} files, {total / 1e9:.2f} GB; server {endpoint}; aws cli: {aws or 'not found'}")
        upload_s = timed(lambda: populate(client, src, f"s3://{BUCKET}/{PREFIX}", PopulateSettings()))
        print(f"populate: {upload_s:.1f} s ({total / upload_s / MB:.0f} MB/s)")
        keys = {f"{PREFIX}/{name}": size for name, size in sizes.items()}
        uri = S3Uri.parse(f"s3://{BUCKET}/{PREFIX}")
        defaults = PullSettings()
        whole = PullSettings(part_size_bytes=-(-max(sizes.values()) // MiB) * MiB)
        whole_nosync = whole.model_copy(update={"fsync": False})
        whole_16 = whole.model_copy(update={"concurrency": TUNED_THREADS})

        def fresh(name: str) -> Path:
            path = scratch / name
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            return path

        def kvfleet(settings: PullSettings) -> Callable[[], None]:
            def run() -> None:
                pull_client = make_client(S3Settings(endpoint_url=endpoint), max_pool_connections=settings.concurrency)
                pull_to_dir(pull_client, uri, fresh("kvfleet"), settings)

            return run

        methods: dict[str, Callable[[], None]] = {
            CEIL_RANGED: lambda: raw_ranged_gets(endpoint, keys, defaults.part_size_bytes, defaults.concurrency),
            CEIL_WHOLE: lambda: raw_whole_gets(endpoint, keys, defaults.concurrency),
            DISK: lambda: disk_write_fsync(fresh("disk"), sizes),
            BOTO3: lambda: boto3_download_file(endpoint, keys, fresh("boto3")),
            BOTO3_TUNED: lambda: boto3_transfer_manager(endpoint, keys, fresh("boto3"), TUNED_THREADS, TUNED_PART),
            BOTO3_TUNED_WHOLE: lambda: boto3_transfer_manager(
                endpoint, keys, fresh("boto3"), TUNED_THREADS, whole.part_size_bytes
            ),
            KV_DEFAULT: kvfleet(defaults),
            KV_WHOLE: kvfleet(whole),
            KV_WHOLE_NOSYNC: kvfleet(whole_nosync),
            KV_WHOLE_16: kvfleet(whole_16),
        }
        if aws:
            methods[AWSCLI] = lambda: aws_cli_cp(aws, endpoint, fresh("awscli"))

        times: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no method always goes first
            for name in order:
                seconds = timed(methods[name])
                times[name].append(seconds)
                print(f"round {r + 1}: {name}: {seconds:.2f} s ({total / seconds / MB:.0f} MB/s)", flush=True)

        node_cache = bench_node_cache(uri, scratch / "node-cache", whole, client, sizes, max(3, args.rounds))
        results = summarize(times, total, len(sizes), args.rounds, upload_s, defaults, whole, node_cache)
        write_reports(results, args.out)
        print(json.dumps(results["ratios"], indent=2))
        print(json.dumps({k: v for k, v in node_cache.items() if k != "samples"}, indent=2))
    finally:
        moto.terminate()
        try:
            moto.wait(timeout=10)
        except subprocess.TimeoutExpired:
            moto.kill()
            moto.wait()
        shutil.rmtree(scratch, ignore_errors=True)


def bench_node_cache(
    uri: S3Uri, root: Path, settings: PullSettings, client: Any, sizes: dict[str, int], rounds: int
) -> dict[str, Any]:
    """Fill the node cache once, then time hits. A cheap hit is the manifest GET + lock + lease + the
    stat check (verify_on_hit="stat": files untouched since verified are not hashed); the engine then
    reads the bytes, so "hit + read" is compared with cat of the same files. The default hit hashes
    every file ("sha256"; bench/node_cache_verify.py has its cost per GB)."""
    sha_settings = settings.model_copy(update={"verify_on_hit": "sha256"})
    settings = settings.model_copy(update={"verify_on_hit": "stat"})
    with pull_model(str(uri), root, settings, client=client, node_cache_settings=NodeCacheSettings()) as model:
        files = [model.path / name for name in sizes]
    cat_files(files)  # warm the page cache for both sides alike
    samples: dict[str, list[float]] = {"hit": [], "hit_plus_read": [], "cat": [], "sha256": []}
    for _ in range(rounds):
        samples["cat"].append(timed(lambda: cat_files(files)))
        started = time.perf_counter()
        with pull_model(str(uri), root, settings, client=client) as hit:
            assert hit.hit
            samples["hit"].append(time.perf_counter() - started)
            read_files(files)
        samples["hit_plus_read"].append(time.perf_counter() - started)
        samples["sha256"].append(timed(lambda: pull_model(str(uri), root, sha_settings, client=client).release()))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "hit_median_s": med["hit"],
        "hit_plus_read_median_s": med["hit_plus_read"],
        "cat_median_s": med["cat"],
        "hit_sha256_verify_median_s": med["sha256"],
        "hit_plus_read_vs_cat": med["hit_plus_read"] / med["cat"],
        "samples": samples,
    }


def summarize(
    times: dict[str, list[float]],
    total: int,
    files: int,
    rounds: int,
    upload_s: float,
    defaults: PullSettings,
    whole: PullSettings,
    node_cache: dict[str, Any],
) -> dict[str, Any]:
    med = {name: statistics.median(v) for name, v in times.items()}
    server_ceiling = min(med[CEIL_RANGED], med[CEIL_WHOLE])
    ratios = {
        "kvfleet_best_vs_boto3_throughput": med[BOTO3] / med[KV_WHOLE],
        "kvfleet_defaults_vs_boto3_throughput": med[BOTO3] / med[KV_DEFAULT],
        "kvfleet_no_fsync_vs_server_ceiling_throughput": server_ceiling / med[KV_WHOLE_NOSYNC],
        "kvfleet_vs_min_of_server_and_disk_ceiling_throughput": max(server_ceiling, med[DISK]) / med[KV_WHOLE],
        "kvfleet_defaults_vs_ranged_ceiling_throughput": med[CEIL_RANGED] / med[KV_DEFAULT],
    }
    if AWSCLI in med:
        ratios["kvfleet_best_vs_awscli_throughput"] = med[AWSCLI] / med[KV_WHOLE]
    # Against the best baseline of all, and the tuned baseline at kvfleet's default request shape.
    baselines = [name for name in (BOTO3, BOTO3_TUNED, BOTO3_TUNED_WHOLE, AWSCLI) if name in med]
    best_baseline = min(baselines, key=lambda name: med[name])
    kv_best = min((KV_WHOLE, KV_WHOLE_16), key=lambda name: med[name])
    ratios["kvfleet_best_vs_best_baseline_throughput"] = med[best_baseline] / med[kv_best]
    ratios["kvfleet_defaults_vs_tuned_boto3_same_parts_throughput"] = med[BOTO3_TUNED] / med[KV_DEFAULT]
    ratios["kvfleet_whole_16_vs_tuned_boto3_whole_files_throughput"] = med[BOTO3_TUNED_WHOLE] / med[KV_WHOLE_16]
    return {
        "best_baseline": best_baseline,
        "kvfleet_best": kv_best,
        "model_bytes": total,
        "files": files,
        "rounds": rounds,
        "settings": {
            "defaults": {"concurrency": defaults.concurrency, "part_size_bytes": defaults.part_size_bytes},
            "whole_file_part_size_bytes": whole.part_size_bytes,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "populate_s": upload_s,
        "pull": {
            name: {
                "seconds": v,
                "median_s": med[name],
                "median_MBps": total / med[name] / MB,
                "spread_pct": 100 * (max(v) - min(v)) / med[name],
            }
            for name, v in times.items()
        },
        "ratios": ratios,
        "node_cache": node_cache,
    }


def write_reports(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_cache.json").write_text(json.dumps(results, indent=2) + "\n")
    pull = results["pull"]
    rows = "\n".join(
        f"| {name} | {p['median_s']:.2f} | {p['median_MBps']:.0f} | {p['spread_pct']:.0f}% |"
        for name, p in pull.items()
    )
    r = results["ratios"]
    nc = results["node_cache"]
    s = results["settings"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    best = results.get("best_baseline", BOTO3)
    best_line = (
        f"| kvfleet at its best, {results.get('kvfleet_best', KV_WHOLE).removeprefix('kvfleet pull ')}, "
        f"vs the best baseline, {best} | "
        f"{r['kvfleet_best_vs_best_baseline_throughput']:.2f}x | >= 1x | "
        f"{verdict(r['kvfleet_best_vs_best_baseline_throughput'] >= 1)} |\n"
        f"| kvfleet (defaults) vs boto3 tuned at the same 32 MiB parts | "
        f"{r['kvfleet_defaults_vs_tuned_boto3_same_parts_throughput']:.2f}x | >= 1x | "
        f"{verdict(r['kvfleet_defaults_vs_tuned_boto3_same_parts_throughput'] >= 1)} |\n"
        f"| kvfleet (whole-file parts, 16 in flight) vs boto3 tuned the same way (16 threads, whole files) | "
        f"{r['kvfleet_whole_16_vs_tuned_boto3_whole_files_throughput']:.2f}x | >= 1x | "
        f"{verdict(r['kvfleet_whole_16_vs_tuned_boto3_whole_files_throughput'] >= 1)} |\n"
        if "kvfleet_best_vs_best_baseline_throughput" in r
        else ""
    )
    aws_line = (
        f"| kvfleet (part size >= largest file) vs `aws s3 cp --recursive` | "
        f"{r['kvfleet_best_vs_awscli_throughput']:.2f}x | >= 2x | "
        f"{verdict(r['kvfleet_best_vs_awscli_throughput'] >= 2)} |\n"
        if "kvfleet_best_vs_awscli_throughput" in r
        else ""
    )
    (out / "weight_cache.md").write_text(
        TEMPLATE.format(
            gb=results["model_bytes"] / 1e9,
            files=results["files"],
            rounds=results["rounds"],
            cpus=results["machine"]["cpus"],
            concurrency=s["defaults"]["concurrency"],
            part_mib=s["defaults"]["part_size_bytes"] // MiB,
            whole_mib=s["whole_file_part_size_bytes"] // MiB,
            rows=rows,
            best_vs_boto=r["kvfleet_best_vs_boto3_throughput"],
            best_vs_boto_ok=verdict(r["kvfleet_best_vs_boto3_throughput"] >= 2),
            def_vs_boto=r["kvfleet_defaults_vs_boto3_throughput"],
            nosync_vs_ceiling=r["kvfleet_no_fsync_vs_server_ceiling_throughput"],
            nosync_ok=verdict(r["kvfleet_no_fsync_vs_server_ceiling_throughput"] >= 0.9),
            vs_both=r["kvfleet_vs_min_of_server_and_disk_ceiling_throughput"],
            vs_both_ok=verdict(r["kvfleet_vs_min_of_server_and_disk_ceiling_throughput"] >= 0.9),
            def_vs_ranged=r["kvfleet_defaults_vs_ranged_ceiling_throughput"],
            aws_line=aws_line,
            best_line=best_line,
            hit=nc["hit_median_s"] * 1000,
            hit_read=nc["hit_plus_read_median_s"],
            cat=nc["cat_median_s"],
            hit_vs_cat=nc["hit_plus_read_vs_cat"],
            hit_ok=verdict(nc["hit_plus_read_vs_cat"] <= 1.2),
            sha=nc["hit_sha256_verify_median_s"],
            populate=results["populate_s"],
            populate_mbps=results["model_bytes"] / results["populate_s"] / MB,
            max_spread=max(p["spread_pct"] for p in pull.values()),
            gap=GAP if r["kvfleet_no_fsync_vs_server_ceiling_throughput"] < 0.9 else "",
        )
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(pull)
    fig, ax = plt.subplots(figsize=(9, 4))

    def color(name: str) -> str:
        if "ceiling" in name:
            return "#9a9a9a"
        return "#2a7ab0" if name.startswith("kvfleet") else "#d08c3c"

    ax.barh(names, [pull[n]["median_MBps"] for n in names], color=[color(n) for n in names])
    ax.set_xlabel("MB/s (median; higher is better)")
    ax.set_title(f"Pulling a {results['model_bytes'] / 1e9:.1f} GB model from a loopback moto S3 server")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "weight_cache.png", dpi=110)
    plt.close(fig)


TEMPLATE = """# Weight cache: pull benchmark

Generated by `bench/weight_pull.py` (rerun it to refresh this file, `weight_cache.json` and
`weight_cache.png`).

**Setup.** A {gb:.2f} GB model ({files} files: safetensors shards plus config and tokenizer files)
in moto's S3 server, run as its own process on a loopback port. Every method downloads the same
objects from the same server in the same run, {rounds} rounds in rotating order; figures are medians.
The machine has {cpus} CPU cores shared by the server, the client and other engineers' work, so the
numbers are noisy: the largest spread (max - min, over the median) of any row was {max_spread:.0f}%.
kvfleet verifies the sha256 of every file while downloading and fsyncs each file before its atomic
rename; boto3 and the AWS CLI do neither. kvfleet's defaults: {concurrency} ranged GETs in flight,
{part_mib} MiB parts. Besides boto3's default (`download_file` one file after another, 8 MiB
ranges, 10 threads), boto3 runs tuned as a careful user would run it: one `TransferManager` with
every file submitted at once, 16 threads and connections, 32 MiB parts, and again with parts as
large as the largest file (one GET per file, files in parallel: the fastest shape on this server,
the same shape as kvfleet's whole-file row).

| method | median s | MB/s | spread |
|---|---|---|---|
{rows}

![throughput](weight_cache.png)

| comparison | measured | goal | |
|---|---|---|---|
{best_line}| kvfleet (part size >= largest file) vs boto3 default | {best_vs_boto:.2f}x | >= 2x | {best_vs_boto_ok} |
{aws_line}| kvfleet, no fsync, vs the server's ceiling | {nosync_vs_ceiling:.2f}x | >= 0.9x | {nosync_ok} |
| kvfleet (with fsync) vs the slower of server and disk ceilings | {vs_both:.2f}x | >= 0.9x | {vs_both_ok} |
| node-cache hit + reading the bytes vs `cat` of them | {hit_vs_cat:.2f}x | <= 1.2x | {hit_ok} |

kvfleet with its defaults ({part_mib} MiB parts) ran at {def_vs_boto:.2f}x boto3's throughput here, and at
{def_vs_ranged:.2f}x the server's own ceiling for that request shape.

**Which part is the server's.** The "server ceiling" rows only GET and discard bytes: no hashing,
no disk. moto answers a GET, ranged or not, by reading and copying the *whole* object under a
per-object lock (`FakeKey.value` in moto/s3/models.py) before slicing out the range, so a ranged
GET costs as much as the whole object and ranges of one object are served one at a time. On this
server many small ranges are the slowest way to read a file: boto3's default (8 MiB ranges, 10
threads, one file after another) pays the whole-object cost for every 8 MiB, and so does kvfleet
with {part_mib} MiB parts, less often. The fastest shape moto offers is one GET per file with the
files in parallel, which kvfleet does with `--part-size-mib {whole_mib}` (parts are streamed in
chunks, so a large part costs no memory). On real S3 a ranged GET costs what its range costs, and
kvfleet's default part size is the one to keep.

**Which part is the disk's.** Writing the same bytes and fsyncing each file ("disk ceiling") is
what kvfleet's durability costs on this machine's virtual disk; with fsync on, a pull cannot beat
the slower of the server's and the disk's ceilings. kvfleet starts writeback while chunks arrive
(`sync_file_range`), so the final fsync mostly finds the data already on disk. The "no fsync" row
isolates the download and hashing path for the comparison with the server's ceiling.

**Against tuned boto3.** Tuned as a careful user would (every file at once, 16 connections), boto3
is a strong baseline on this server, and with whole-file parts it is the best of the baselines.
It does less per byte than kvfleet: no sha256 of the bytes against the manifest, no fsync, no
atomic rename, so a crash or a corrupt object leaves a model it cannot tell from a good one. The
"no fsync" row takes the disk out of kvfleet's figure; the hash (one pass over every byte on the
same 2 cores moto uses) stays, because verification is the point of the cache. Where kvfleet
trails the best baseline, that is the price of those guarantees on this machine, measured.

{gap}**Node cache.** A hit with `verify_on_hit=stat` (manifest GET, lock, lease, stat of every file) took {hit:.1f} ms.
A hit plus reading every byte once (what the engine's loader does next) took {hit_read:.2f} s, against
{cat:.2f} s for `cat` of the same files from the page cache. A hit that rehashes every file
(`verify_on_hit=sha256`, the default) took {sha:.2f} s.

Populating the model (multipart upload, 64 MiB parts, 8 in flight, with the local sha256 pass)
took {populate:.1f} s ({populate_mbps:.0f} MB/s).

**GPU.** No GPU was available for this run; the pull path does not use one.
"""

GAP = """**Why kvfleet stays below the server's ceiling here.** The ceiling rows do no work per byte on
the client; kvfleet hashes every byte (sha256, about 1.7 GB/s on one core of this machine) and
writes it to the page cache. On 2 cores, with moto using one of them and other work running on the
shared machine, that client work takes time the raw GETs do not pay, and the no-fsync row's
spread shows how much the shared machine moved it.
Skipping the hash would close the gap and lose the verification the issue asks for, so it stays.

"""


if __name__ == "__main__":
    main()
