"""Router overhead: added latency, sustained throughput and CPU per request, router vs nginx vs the backend.

All measured in one run on this machine:
- latency: ``--streams`` concurrent SSE streams (closed loop) against a streaming backend
  (tests/router/backend.py, a separate process), directly, through nginx (proxy_buffering off) and
  through ``kvfleet router serve``; added latency = through-proxy minus direct, per percentile. The
  generator is light: uvloop plus an httptools-parsed HTTP/1.1 client (``kvfleet.router.upstream``,
  the same client for every path), not aiohttp's client.
- throughput: wrk (one thread, POST, keep-alive) against nginx serving a fixed JSON answer as the
  fastest backend, directly, through an nginx proxy, and through the router; and the proxy process's
  own CPU time per request over the wrk run (utime + stime from /proc), which other jobs on the
  machine do not inflate the way they do req/s. Two request bodies: a short completion (the
  proxy's fixed cost) and a chat request with a ~16k-character (~4k-token) system prompt (what the
  router's prefix hashing and index cost on a realistic prompt; nginx only copies the bytes). And
  ``kvfleet-4``: the router picking among 4 replicas (4 ports of the same backend), throughput only,
  so the one-replica shortcut does not flatter the figure. ``kvfleet-4 + KV events``: the same with
  KV-cache events on: the model's tokenizer loaded (the tiny test model's 1024-token BPE and chat
  template) and every replica's event view live (a publisher in this process sends, twice a second,
  the stored blocks of the long prompt's shared system prompt as an engine would), so every request
  is tokenized and scored against the engines' reported caches: the router's path with events on.
  The router's resident memory (VmRSS) after each round's runs is reported for every router.
Pinning (when the machine has 2+ cores): the proxy under test -- the nginx proxy worker or the
router, each one process -- runs alone on ``--proxy-cpu``; backends and load generators share
``--load-cpu``. Other engineers' jobs still share both cores.

    .venv/bin/python bench/router_overhead.py                 # ~4 minutes
    .venv/bin/python bench/router_overhead.py --seconds 20 --streams 10,100,200
    .venv/bin/python bench/router_overhead.py --before-src /tmp/before/router   # adds an older router, same run

Writes docs/benchmarks/router_overhead.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import uvloop

from kvfleet.free_port import pick_free_port
from kvfleet.router.upstream import PoolSettings, UpstreamIOError, UpstreamPool

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
BACKEND = ROOT / "tests" / "router" / "backend.py"
STATIC_BODY = '{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hello world"}]}'


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
def process(cmd: list[str], health_url: str, cpu: int | None = None) -> Iterator[subprocess.Popen[bytes]]:
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]  # taskset execs: the pid stays the command's
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
def nginx(server_block: str, port: int, workdir: Path, cpu: int | None = None) -> Iterator[int]:
    """nginx with one worker; yields the worker's pid (the process that does the work)."""
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
    with process(cmd, f"http://127.0.0.1:{port}/health", cpu) as master:
        children = Path(f"/proc/{master.pid}/task/{master.pid}/children").read_text().split()
        yield int(children[0]) if children else master.pid


def static_backend_block(ports: list[int]) -> str:
    listens = "\n    ".join(f"listen 127.0.0.1:{port};" for port in ports)
    return f"""server {{
    {listens}
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
      # Bodies up to 1 MiB stay in memory (the default 16k spills a 4k-token prompt to a temp file).
      client_body_buffer_size 1m;
    }}
  }}"""


@contextmanager
def router(
    upstreams: list[str],
    port: int,
    cpu: int | None = None,
    src: Path | None = None,
    events: tuple[int, Path] | None = None,
) -> Iterator[int]:
    """``kvfleet router serve``; ``src``: serve from another checkout's router/ folder (a before/after run);
    ``events``: (port, tokenizer folder) to subscribe every replica's KV events at that port."""
    boot = "from kvfleet.cli import main; main()"
    if src is not None:
        boot = f"import kvfleet.router as r; r.__path__[:] = [{str(src)!r}]; " + boot
    cmd = [
        sys.executable,
        "-c",
        boot,
        "router",
        "serve",
        "--port",
        str(port),
        *(arg for upstream in upstreams for arg in ("--replica", f"bench={upstream}")),
        "--log-level",
        "WARNING",
    ]
    if events is not None:
        events_port, tokenizer_dir = events
        cmd += ["--kv-events-port", str(events_port), "--kv-events-tokenizer", f"bench={tokenizer_dir}"]
    with process(cmd, f"http://127.0.0.1:{port}/health", cpu) as proc:
        yield proc.pid


def rss_mib(pid: int) -> float:
    """Resident memory of the process (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def engine_events(port: int, tokenizer_dir: Path, block_size: int = 16) -> Iterator[int]:
    """Publishes, as an engine would, the blocks of the long prompt's system prompt (all but the
    final partial block), twice a second, on ``port``: each router's views are live and hold them."""
    import threading

    from kvfleet.engine.kv_events import KVEventsConfig, ZmqEventPublisher, block_stored
    from kvfleet.router.prompt_tokens import load_tokenizer, prompt_token_ids

    tokens = prompt_token_ids(load_tokenizer(tokenizer_dir), LONG_BODY)
    assert tokens, "the tiny tokenizer must take the long prompt"
    full = len(tokens) // block_size * block_size
    batch = [
        block_stored(
            [i.to_bytes(8, "big")], (i - 1).to_bytes(8, "big") if i else None, tokens[at : at + block_size], block_size
        )
        for i, at in enumerate(range(0, full, block_size))
    ]
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}"))
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            publisher.publish(batch)

    thread = threading.Thread(target=loop, name="engine-events", daemon=True)
    thread.start()
    try:
        yield len(batch)
    finally:
        stop.set()
        thread.join()
        publisher.close()


def wait_events_live(port: int, replicas: int = 4, timeout_s: float = 30) -> None:
    """Until the router reports every replica's event view usable: the path measured is the events path."""
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(r"^kvfleet_router_kv_event_subscriptions_usable\{[^}]*\} (\S+)$", re.M)
    usable = 0.0
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            usable = sum(float(v) for v in pattern.findall(response.read().decode()))
        if usable >= replicas:
            return
        time.sleep(0.2)
    raise RuntimeError(f"only {usable:g} of {replicas} event views became usable in {timeout_s:g} s")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# -- latency ------------------------------------------------------------------------------------------


async def stream_latency(url: str, streams: int, seconds: float, chunks: int, delay_s: float) -> dict[str, Any]:
    knobs = {"chunks": chunks, "delay_s": delay_s}
    body = json.dumps({"model": "bench", "prompt": "hello", "stream": True, "kvfleet_test": knobs}).encode()
    headers = b"Content-Type: application/json\r\n"
    ttfb: list[float] = []
    total: list[float] = []
    errors = 0
    pool = UpstreamPool(
        PoolSettings(max_connections_per_origin=streams, keepalive_timeout_s=60, connect_timeout_s=5, read_timeout_s=30)
    )
    now = time.perf_counter  # uvloop's loop.time() ticks in whole milliseconds
    warm_until = now() + min(2.0, seconds / 4)
    stop_at = warm_until + seconds

    async def worker() -> None:
        nonlocal errors
        while now() < stop_at:
            t0 = now()
            try:
                with await pool.send(url, "/v1/completions", headers, body) as resp:
                    first = None
                    while await resp.readany():
                        if first is None:
                            first = now()
            except UpstreamIOError:
                errors += 1
                continue
            if resp.status != 200 or first is None:
                errors += 1
                continue
            t1 = now()
            if t0 >= warm_until:
                ttfb.append(first - t0)
                total.append(t1 - t0)

    try:
        await asyncio.gather(*(worker() for _ in range(streams)))
    finally:
        await pool.close()
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


EVENTS = "kvfleet-4 + KV events"
SHORT_BODY = {"model": "bench", "prompt": "hello there", "max_tokens": 8}
# One shared ~16k-character system prompt (a tenant's instructions and tool schemas) and a short question.
LONG_BODY = {
    "model": "bench",
    "messages": [
        {"role": "system", "content": "You are the support assistant of a hardware shop; cite the manual. " * 240},
        {"role": "user", "content": "Which drill bit do I need for concrete?"},
    ],
    "max_tokens": 8,
}


def wrk(
    url: str, seconds: float, connections: int, workdir: Path, proxy_pid: int | None, body: dict[str, Any]
) -> dict[str, float]:
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"  # a Lua string literal: JSON string escaping suffices
    )
    cpu_before = cpu_seconds(proxy_pid) if proxy_pid else 0.0
    out = subprocess.run(
        [
            "wrk",
            "-t",
            "1",
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
    cpu_used_s = cpu_seconds(proxy_pid) - cpu_before if proxy_pid else float("nan")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    done = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    return {
        "rps": rps,
        "non_2xx": float(non2xx.group(1)) if non2xx else 0.0,
        "p50_ms": parse_ms(out, "50%"),
        "p99_ms": parse_ms(out, "99%"),
        "socket_errors": 1.0 if errors else 0.0,
        "proxy_cpu_us_per_request": cpu_used_s / max(1, done) * 1e6,
        "proxy_cpu_share": cpu_used_s / seconds,
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
    parser.add_argument("--proxy-cpu", type=int, default=0, help="core for the proxy under test")
    parser.add_argument("--load-cpu", type=int, default=1, help="core for backends and load generators")
    parser.add_argument("--no-pin", action="store_true", help="let the scheduler place everything")
    parser.add_argument(
        "--before-src",
        type=Path,
        help="another checkout's router/ folder, measured as 'kvfleet-before' in the same run",
    )
    args = parser.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (scripts/bootstrap installs it)")
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    proxy_cpu = args.proxy_cpu if pin else None
    if pin:
        os.sched_setaffinity(0, {args.load_cpu})  # this generator, wrk and the backends inherit it
    rounds: list[dict[str, Any]] = []
    levels = [int(x) for x in str(args.streams).split(",")]
    proxies = ["nginx", "kvfleet"] + (["kvfleet-before"] if args.before_src else [])
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        stream_port = pick_free_port()
        static_ports = [pick_free_port() for _ in range(4)]
        static_port = static_ports[0]
        stream_url = f"http://127.0.0.1:{stream_port}"
        static_urls = [f"http://127.0.0.1:{port}" for port in static_ports]
        backend_cmd = [sys.executable, str(BACKEND), "--port", str(stream_port), "--replica-id", "bench"]
        stack.enter_context(process(backend_cmd, stream_url + "/health"))
        stack.enter_context(nginx(static_backend_block(static_ports), static_port, workdir))
        # name -> (streaming port or None (no latency test), static port, pid serving the static path)
        ports: dict[str, tuple[int | None, int, int | None]] = {"direct": (stream_port, static_port, None)}
        for name in proxies:
            a, b = pick_free_port(), pick_free_port()
            if name == "nginx":
                stack.enter_context(nginx(proxy_block(a, stream_port), a, workdir, proxy_cpu))
                pid = stack.enter_context(nginx(proxy_block(b, static_port), b, workdir, proxy_cpu))
            else:
                src = args.before_src if name == "kvfleet-before" else None
                stack.enter_context(router([stream_url], a, proxy_cpu, src))
                pid = stack.enter_context(router(static_urls[:1], b, proxy_cpu, src))
            ports[name] = (a, b, pid)
        four = pick_free_port()
        ports["kvfleet-4"] = (None, four, stack.enter_context(router(static_urls, four, proxy_cpu)))
        from kvfleet.engine.tiny_model import make_tiny_model

        tokenizer_dir = make_tiny_model(workdir / "tiny", layers=1, hidden=32, vocab=1024)
        events_port, four_events = pick_free_port(), pick_free_port()
        blocks = stack.enter_context(engine_events(events_port, tokenizer_dir))
        print(f"engine events: {blocks} blocks of the long prompt published on port {events_port}")
        pid = stack.enter_context(router(static_urls, four_events, proxy_cpu, events=(events_port, tokenizer_dir)))
        ports[EVENTS] = (None, four_events, pid)
        wait_events_live(four_events)
        for r in range(args.repeats):
            result: dict[str, Any] = {"latency": {}, "throughput": {}, "throughput_long": {}}
            for streams in levels:
                for name, (port, _, _) in ports.items():
                    if port is None:
                        continue
                    url = f"http://127.0.0.1:{port}"
                    lat = uvloop.run(stream_latency(url, streams, args.seconds, args.chunks, args.chunk_delay_s))
                    result["latency"][f"{name}@{streams}"] = lat
                    print(
                        f"round {r} latency {name:14s} x{streams:<4d} ttfb p50 {lat['ttfb_s']['p50'] * 1000:.2f} ms "
                        f"p99 {lat['ttfb_s']['p99'] * 1000:.2f} ms ({lat['requests']} req, {lat['errors']} errors)"
                    )
            for key, body in (("throughput", SHORT_BODY), ("throughput_long", LONG_BODY)):
                for name, (_, port, pid) in ports.items():
                    got = wrk(f"http://127.0.0.1:{port}", args.seconds, args.connections, workdir, pid, body)
                    if name != "direct" and not name.startswith("nginx") and pid is not None:
                        got["rss_mib"] = rss_mib(pid)
                    result[key][name] = got
                    print(
                        f"round {r} {key} {name:14s} {got['rps']:.0f} req/s, proxy CPU "
                        f"{got['proxy_cpu_us_per_request']:.1f} us/req at {got['proxy_cpu_share']:.0%} of a core"
                    )
            rounds.append(result)
    write(args, levels, rounds, ["direct", *proxies], pin)


def median_of(rounds: list[dict[str, Any]], *path: str) -> float:
    values = []
    for r in rounds:
        v: Any = r
        for key in path:
            v = v[key]
        values.append(float(v))
    return statistics.median(values)


def write(
    args: argparse.Namespace, levels: list[int], rounds: list[dict[str, Any]], paths: list[str], pin: bool
) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    proxies = [p for p in paths if p != "direct"]
    summary: dict[str, Any] = {
        "latency_ms": {},
        "added_latency_ms": {},
        "throughput_rps": {},
        "proxy_cpu_us_per_request": {},
        "proxy_cpu_share": {},
    }
    for level in levels:
        for name in paths:
            key = f"{name}@{level}"
            summary["latency_ms"][key] = {
                f"{metric}_{q}": median_of(rounds, "latency", key, f"{metric}_s", q) * 1000
                for metric in ("ttfb", "total")
                for q in ("p50", "p99")
            }
        for name in proxies:
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
    tpaths = [*paths, "kvfleet-4", EVENTS]  # measured for throughput only
    tproxies = [p for p in tpaths if p != "direct"]
    ratios: dict[str, dict[str, float]] = {}
    for key in ("throughput", "throughput_long"):
        summary[f"{key}_rps"] = {name: median_of(rounds, key, name, "rps") for name in tpaths}
        summary[f"{key}_proxy_cpu_us_per_request"] = {
            name: median_of(rounds, key, name, "proxy_cpu_us_per_request") for name in tproxies
        }
        summary[f"{key}_proxy_cpu_share"] = {name: median_of(rounds, key, name, "proxy_cpu_share") for name in tproxies}
        # Per round, then the median: the ratio in one round compares runs seconds apart.
        ratios[key] = {
            name: statistics.median(r[key][name]["rps"] / r[key]["nginx"]["rps"] for r in rounds) for name in tproxies
        }
    # After the round's last run (the long prompts): what the router holds once it has served both.
    summary["router_rss_mib"] = {
        name: median_of(rounds, "throughput_long", name, "rss_mib")
        for name in tproxies
        if "rss_mib" in rounds[0]["throughput_long"][name]
    }
    summary["proxy_cpu_us_per_request"] = summary["throughput_proxy_cpu_us_per_request"]
    summary["proxy_cpu_share"] = summary["throughput_proxy_cpu_share"]
    summary["throughput_ratio_vs_nginx"] = ratios["throughput"]
    summary["throughput_long_ratio_vs_nginx"] = ratios["throughput_long"]
    ratio = ratios["throughput"]["kvfleet"]
    cpu = summary["proxy_cpu_us_per_request"]
    cpu_ratio = cpu["nginx"] / cpu["kvfleet"]
    summary["cpu_efficiency_vs_nginx"] = cpu_ratio
    spread = {name: [round(r["throughput"][name]["rps"]) for r in rounds] for name in tpaths}
    load = os.getloadavg()
    (out / "router_overhead.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "pinned": pin,
                "cpus": os.cpu_count(),
                "load_average_at_end": load,
                "summary": summary,
                "rounds": rounds,
            },
            indent=2,
        )
    )
    lat, added = summary["latency_ms"], summary["added_latency_ms"]
    placement = (
        f"proxy under test alone on core {args.proxy_cpu}, backends and generators on core {args.load_cpu}"
        if pin
        else "unpinned"
    )
    lines = [
        f"{args.repeats} rounds x {args.seconds:g} s per measurement on {os.cpu_count()} cores shared with other "
        f"jobs (load average {load[0]:.1f} at the end); {placement}; medians over rounds.",
        "",
        f"Latency: concurrent SSE streams ({args.chunks} events, {args.chunk_delay_s * 1000:g} ms apart) from a "
        "uvloop + httptools client; TTFB = time to the first body byte; added = proxy minus direct in the same round.",
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
    long_cpu = summary["throughput_long_proxy_cpu_us_per_request"]
    lines += [
        "",
        f"Throughput: wrk (1 thread), {args.connections} keep-alive connections, POST, against nginx returning a "
        "fixed JSON answer. Short: a one-line completion. Long: a chat request with a ~16k-character system "
        "prompt. kvfleet-4: the router choosing among 4 replicas (4 ports of that nginx). Proxy CPU = the proxy "
        "process's utime + stime over the run / requests served.",
        "",
        "| path | short: req/s | vs nginx | per round | proxy CPU (us/req) | share of a core "
        "| long: req/s | vs nginx | proxy CPU (us/req) | RSS after (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rss = summary["router_rss_mib"]
    for name in tpaths:
        vs = f"{ratios['throughput'][name]:.0%}" if name in cpu else "-"
        c = f"{cpu[name]:.1f} | {summary['proxy_cpu_share'][name]:.0%}" if name in cpu else "- | -"
        long_vs = f"{ratios['throughput_long'][name]:.0%}" if name in long_cpu else "-"
        long_c = f"{long_cpu[name]:.1f}" if name in long_cpu else "-"
        lines.append(
            f"| {name} | {summary['throughput_rps'][name]:.0f} | {vs} | {spread[name]} | {c} | "
            f"{summary['throughput_long_rps'][name]:.0f} | {long_vs} | {long_c} | "
            f"{f'{rss[name]:.0f}' if name in rss else '-'} |"
        )
    events_cpu = {key: summary[f"{key}_proxy_cpu_us_per_request"] for key in ("throughput", "throughput_long")}
    lines += [
        "",
        f"KV events on ({EVENTS} against kvfleet-4, the same run): CPU per request "
        f"{events_cpu['throughput']['kvfleet-4']:.0f} -> {events_cpu['throughput'][EVENTS]:.0f} us (short), "
        f"{events_cpu['throughput_long']['kvfleet-4']:.0f} -> {events_cpu['throughput_long'][EVENTS]:.0f} us "
        f"(long: the tokenizing); memory after {rss.get('kvfleet-4', float('nan')):.0f} -> "
        f"{rss.get(EVENTS, float('nan')):.0f} MiB (the tokenizer and the four views).",
    ]
    top = max(levels)
    p50, p99 = added[f"kvfleet@{top}"]["ttfb_p50"], added[f"kvfleet@{top}"]["ttfb_p99"]
    lines += [
        "",
        "| goal | measured | met |",
        "|---|---|---|",
        f"| added p50 <= 1 ms at {top} streams | {p50:.2f} ms | {'yes' if p50 <= 1 else 'NO'} |",
        f"| added p99 <= 5 ms at {top} streams | {p99:.2f} ms | {'yes' if p99 <= 5 else 'NO'} |",
        f"| throughput >= 30% of nginx's | {ratio:.0%} | {'yes' if ratio >= 0.3 else 'NO'} |",
        f"| (the same, 4 replicas) | {ratios['throughput']['kvfleet-4']:.0%} | "
        f"{'yes' if ratios['throughput']['kvfleet-4'] >= 0.3 else 'NO'} |",
        f"| (the same, ~4k-token prompts) | {ratios['throughput_long']['kvfleet']:.0%} | "
        f"{'yes' if ratios['throughput_long']['kvfleet'] >= 0.3 else 'NO'} |",
        f"| (CPU per request, nginx's / kvfleet's) | {cpu_ratio:.0%} | {'yes' if cpu_ratio >= 0.3 else 'NO'} |",
    ]
    (out / "router_overhead.md").write_text("\n".join(lines) + "\n")
    plot(out / "router_overhead.png", levels, summary, paths, tpaths)
    print("\n".join(lines))


def plot(path: Path, levels: list[int], summary: dict[str, Any], names: list[str], tnames: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(levels) + 2, figsize=(5 * (len(levels) + 2), 4))
    lat = summary["latency_ms"]
    xs = range(len(names))
    for ax, level in zip(axes, levels, strict=False):
        ax.bar([x - 0.2 for x in xs], [lat[f"{n}@{level}"]["ttfb_p50"] for n in names], 0.4, label="TTFB p50")
        ax.bar([x + 0.2 for x in xs], [lat[f"{n}@{level}"]["ttfb_p99"] for n in names], 0.4, label="TTFB p99")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("ms")
        ax.set_title(f"time to first byte, {level} SSE streams")
        ax.legend()
    b = axes[len(levels)]
    txs = range(len(tnames))
    for offset, key, label in ((-0.2, "throughput_rps", "short prompt"), (0.2, "throughput_long_rps", "~4k tokens")):
        b.bar([x + offset for x in txs], [summary[key][n] for n in tnames], 0.4, label=label)
    b.set_xticks(list(txs), tnames)
    b.set_ylabel("requests/s")
    b.set_title("sustained throughput (wrk)")
    b.legend()
    c = axes[len(levels) + 1]
    proxies = [n for n in tnames if n != "direct"]
    pxs = range(len(proxies))
    for offset, key, label in (
        (-0.2, "throughput_proxy_cpu_us_per_request", "short prompt"),
        (0.2, "throughput_long_proxy_cpu_us_per_request", "~4k tokens"),
    ):
        c.bar([x + offset for x in pxs], [summary[key][n] for n in proxies], 0.4, label=label)
    c.set_xticks(list(pxs), proxies)
    c.set_ylabel("CPU microseconds per request")
    c.set_title("proxy CPU per request (lower is better)")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
