"""Router overhead: added latency and highest sustained throughput, router vs nginx vs straight to the backend.

All measured in one run on this machine:
- latency: ``--streams`` concurrent SSE streams (closed loop, an aiohttp client) against a streaming
  backend (tests/router/backend.py, a separate process), directly, through nginx (proxy_buffering
  off) and through ``kvfleet router serve``; added latency = through-proxy minus direct, per percentile.
- throughput: wrk (POST, keep-alive) against nginx serving a fixed JSON answer as the fastest
  possible backend, directly, through an nginx proxy, and through the router.
nginx and the router each run as one process (worker_processes 1) so they get the same CPU.
The load generator shares the machine's cores with everything it measures.

    .venv/bin/python bench/router_overhead.py                 # ~2 minutes
    .venv/bin/python bench/router_overhead.py --seconds 20 --streams 200

Writes docs/benchmarks/router_overhead.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
BACKEND = ROOT / "tests" / "router" / "backend.py"
STATIC_BODY = '{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hello world"}]}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up") from None
            time.sleep(0.05)


@contextmanager
def process(cmd: list[str], health_url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(health_url)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if not found:
        raise SystemExit("nginx is not installed (scripts/bootstrap installs it)")
    return found


@contextmanager
def nginx(server_block: str, port: int, workdir: Path) -> Iterator[None]:
    prefix = workdir / f"nginx-{port}"
    prefix.mkdir()
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = f"""{user}worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  keepalive_requests 1000000;
  {server_block}
}}
"""
    (prefix / "nginx.conf").write_text(conf)
    cmd = [nginx_binary(), "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"]
    with process(cmd, f"http://127.0.0.1:{port}/health"):
        yield


def static_backend_block(port: int) -> str:
    return f"""server {{
    listen 127.0.0.1:{port};
    location /health {{ return 200 "ok"; }}
    location / {{ default_type application/json; return 200 '{STATIC_BODY}'; }}
  }}"""


def proxy_block(port: int, upstream_port: int) -> str:
    return f"""upstream backend {{ server 127.0.0.1:{upstream_port}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}"""


@contextmanager
def router(upstream: str, port: int) -> Iterator[None]:
    cmd = [
        sys.executable,
        "-c",
        "from kvfleet.cli import main; main()",
        "router",
        "serve",
        "--port",
        str(port),
        "--replica",
        f"bench={upstream}",
        "--log-level",
        "WARNING",
    ]
    with process(cmd, f"http://127.0.0.1:{port}/health"):
        yield


# -- latency ------------------------------------------------------------------------------------------


async def stream_latency(url: str, streams: int, seconds: float, chunks: int, delay_s: float) -> dict[str, Any]:
    knobs = {"chunks": chunks, "delay_s": delay_s}
    body = {"model": "bench", "prompt": "hello", "stream": True, "kvfleet_test": knobs}
    ttfb: list[float] = []
    total: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        loop = asyncio.get_running_loop()
        warm_until = loop.time() + min(2.0, seconds / 4)
        stop_at = warm_until + seconds

        async def worker() -> None:
            nonlocal errors
            while loop.time() < stop_at:
                t0 = loop.time()
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        first = None
                        async for _ in resp.content.iter_any():
                            if first is None:
                                first = loop.time()
                        if resp.status != 200 or first is None:
                            errors += 1
                            continue
                except aiohttp.ClientError:
                    errors += 1
                    continue
                t1 = loop.time()
                if t0 >= warm_until:
                    ttfb.append(first - t0)
                    total.append(t1 - t0)

        await asyncio.gather(*(worker() for _ in range(streams)))
    return {"ttfb_s": summarise(ttfb), "total_s": summarise(total), "requests": len(total), "errors": errors}


def summarise(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    return {
        "p50": values[len(values) // 2],
        "p99": values[min(len(values) - 1, int(len(values) * 0.99))],
        "mean": statistics.mean(values),
    }


# -- throughput ---------------------------------------------------------------------------------------


def wrk(url: str, seconds: float, connections: int, workdir: Path) -> dict[str, float]:
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.body = \'{"model": "bench", "prompt": "hello there", "max_tokens": 8}\'\n'
    )
    out = subprocess.run(
        [
            "wrk",
            "-t",
            "2",
            "-c",
            str(connections),
            "-d",
            f"{seconds:g}s",
            "--latency",
            "-s",
            str(script),
            url + "/v1/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    return {
        "rps": rps,
        "non_2xx": float(non2xx.group(1)) if non2xx else 0.0,
        "p50_ms": parse_ms(out, "50%"),
        "p99_ms": parse_ms(out, "99%"),
        "socket_errors": 1.0 if errors else 0.0,
    }


def parse_ms(out: str, label: str) -> float:
    m = re.search(rf"{re.escape(label)}\s+([\d.]+)(us|ms|s)", out)
    if not m:
        return float("nan")
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    parser.add_argument(
        "--streams", default="10,100", help="comma-separated concurrent SSE stream counts for the latency test"
    )
    parser.add_argument("--chunks", type=int, default=8, help="SSE events per stream")
    parser.add_argument("--chunk-delay-s", type=float, default=0.02)
    parser.add_argument("--connections", type=int, default=64, help="wrk connections in the throughput test")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians over rounds are reported")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (scripts/bootstrap installs it)")
    rounds: list[dict[str, Any]] = []
    levels = [int(x) for x in str(args.streams).split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        stream_port, static_port = free_port(), free_port()
        nginx_stream_port, nginx_static_port = free_port(), free_port()
        router_stream_port, router_static_port = free_port(), free_port()
        stream_url = f"http://127.0.0.1:{stream_port}"
        static_url = f"http://127.0.0.1:{static_port}"
        backend_cmd = [sys.executable, str(BACKEND), "--port", str(stream_port), "--replica-id", "bench"]
        with (
            process(backend_cmd, stream_url + "/health"),
            nginx(static_backend_block(static_port), static_port, workdir),
            nginx(proxy_block(nginx_stream_port, stream_port), nginx_stream_port, workdir),
            nginx(proxy_block(nginx_static_port, static_port), nginx_static_port, workdir),
            router(stream_url, router_stream_port),
            router(static_url, router_static_port),
        ):
            for r in range(args.repeats):
                result: dict[str, Any] = {"latency": {}, "throughput": {}}
                for streams in levels:
                    for name, port in [
                        ("direct", stream_port),
                        ("nginx", nginx_stream_port),
                        ("kvfleet", router_stream_port),
                    ]:
                        url = f"http://127.0.0.1:{port}"
                        lat = asyncio.run(stream_latency(url, streams, args.seconds, args.chunks, args.chunk_delay_s))
                        result["latency"][f"{name}@{streams}"] = lat
                        print(
                            f"round {r} latency {name:8s} x{streams:<4d} ttfb p50 {lat['ttfb_s']['p50'] * 1000:.2f} ms "
                            f"p99 {lat['ttfb_s']['p99'] * 1000:.2f} ms ({lat['requests']} req, {lat['errors']} errors)"
                        )
                for name, port in [
                    ("direct", static_port),
                    ("nginx", nginx_static_port),
                    ("kvfleet", router_static_port),
                ]:
                    result["throughput"][name] = wrk(
                        f"http://127.0.0.1:{port}", args.seconds, args.connections, workdir
                    )
                    print(f"round {r} throughput {name:8s} {result['throughput'][name]['rps']:.0f} req/s")
                rounds.append(result)
    write(args, levels, rounds)


def median_of(rounds: list[dict[str, Any]], *path: str) -> float:
    values = []
    for r in rounds:
        v: Any = r
        for key in path:
            v = v[key]
        values.append(float(v))
    return statistics.median(values)


def write(args: argparse.Namespace, levels: list[int], rounds: list[dict[str, Any]]) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    paths = ("direct", "nginx", "kvfleet")
    summary: dict[str, Any] = {"latency_ms": {}, "added_latency_ms": {}, "throughput_rps": {}}
    for level in levels:
        for name in paths:
            key = f"{name}@{level}"
            summary["latency_ms"][key] = {
                f"{metric}_{q}": median_of(rounds, "latency", key, f"{metric}_s", q) * 1000
                for metric in ("ttfb", "total")
                for q in ("p50", "p99")
            }
        for name in ("nginx", "kvfleet"):
            # Per round: proxy minus direct in the same round, then the median over rounds.
            summary["added_latency_ms"][f"{name}@{level}"] = {
                f"{metric}_{q}": statistics.median(
                    (
                        r["latency"][f"{name}@{level}"][f"{metric}_s"][q]
                        - r["latency"][f"direct@{level}"][f"{metric}_s"][q]
                    )
                    * 1000
                    for r in rounds
                )
                for metric in ("ttfb", "total")
                for q in ("p50", "p99")
            }
    for name in paths:
        summary["throughput_rps"][name] = median_of(rounds, "throughput", name, "rps")
    ratio = summary["throughput_rps"]["kvfleet"] / summary["throughput_rps"]["nginx"]
    summary["throughput_ratio_vs_nginx"] = ratio
    spread = {name: [round(r["throughput"][name]["rps"]) for r in rounds] for name in paths}
    (out / "router_overhead.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "cpus": os.cpu_count(),
                "load_average_at_end": os.getloadavg(),
                "summary": summary,
                "rounds": rounds,
            },
            indent=2,
        )
    )
    lat, added = summary["latency_ms"], summary["added_latency_ms"]
    lines = [
        f"{args.repeats} rounds x {args.seconds:g} s per measurement on {os.cpu_count()} shared cores "
        f"(load average {os.getloadavg()[0]:.1f} at the end); medians over rounds.",
        "",
        f"Latency: concurrent SSE streams ({args.chunks} events, {args.chunk_delay_s * 1000:g} ms apart) from an "
        "aiohttp client; TTFB = time to the first body byte; added = proxy minus direct in the same round.",
        "",
        "| streams | path | TTFB p50 (ms) | TTFB p99 (ms) | stream p50 (ms) | stream p99 (ms) "
        "| added TTFB p50 (ms) | added TTFB p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        for name in paths:
            m = lat[f"{name}@{level}"]
            a = added.get(f"{name}@{level}")
            extra = f"{a['ttfb_p50']:.2f} | {a['ttfb_p99']:.2f}" if a else "- | -"
            lines.append(
                f"| {level} | {name} | {m['ttfb_p50']:.2f} | {m['ttfb_p99']:.2f} | {m['total_p50']:.1f} | "
                f"{m['total_p99']:.1f} | {extra} |"
            )
    lines += [
        "",
        f"Throughput: wrk, {args.connections} keep-alive connections, POST, "
        "against nginx returning a fixed JSON answer.",
        "",
        "| path | req/s (median) | per round |",
        "|---|---|---|",
    ]
    for name in paths:
        lines.append(f"| {name} | {summary['throughput_rps'][name]:.0f} | {spread[name]} |")
    top = max(levels)
    p50, p99 = added[f"kvfleet@{top}"]["ttfb_p50"], added[f"kvfleet@{top}"]["ttfb_p99"]
    lines += [
        "",
        "| goal | measured | met |",
        "|---|---|---|",
        f"| added p50 <= 1 ms at {top} streams | {p50:.2f} ms | {'yes' if p50 <= 1 else 'NO'} |",
        f"| added p99 <= 5 ms at {top} streams | {p99:.2f} ms | {'yes' if p99 <= 5 else 'NO'} |",
        f"| throughput >= 30% of nginx's | {ratio:.0%} | {'yes' if ratio >= 0.3 else 'NO'} |",
    ]
    (out / "router_overhead.md").write_text("\n".join(lines) + "\n")
    plot(out / "router_overhead.png", levels, summary)
    print("\n".join(lines))


def plot(path: Path, levels: list[int], summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["direct", "nginx", "kvfleet"]
    fig, axes = plt.subplots(1, len(levels) + 1, figsize=(5.5 * (len(levels) + 1), 4))
    lat = summary["latency_ms"]
    xs = range(len(names))
    for ax, level in zip(axes, levels, strict=False):
        ax.bar([x - 0.2 for x in xs], [lat[f"{n}@{level}"]["ttfb_p50"] for n in names], 0.4, label="TTFB p50")
        ax.bar([x + 0.2 for x in xs], [lat[f"{n}@{level}"]["ttfb_p99"] for n in names], 0.4, label="TTFB p99")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("ms")
        ax.set_title(f"time to first byte, {level} concurrent SSE streams")
        ax.legend()
    b = axes[-1]
    b.bar(names, [summary["throughput_rps"][n] for n in names], color=["grey", "tab:green", "tab:blue"])
    b.set_ylabel("requests/s")
    b.set_title("sustained throughput (wrk)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
