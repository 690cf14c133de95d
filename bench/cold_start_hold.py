"""Holding requests through a cold start: what the SSE comments cost the router, against today's hold.

One run, two arms on the same machine, alternating round by round:
- ``comments off``: the hold as it was (``cold_start_comments: false``): a held stream gets nothing
  until its first token;
- ``comments on``: the default, a comment at once and then every ``--interval-s``.

Each round starts a fresh router process (``--serve`` mode of this script: the real ``RouterServer``
with a static source) whose model has no replica; ``--streams`` concurrent streamed requests arrive at
once and are held; the first wake starts a cold start of ``--cold-s`` seconds, after which a backend
process (tests/router/backend.py, started before the round so its start-up is not timed) is added and
every held stream is served a short answer. The router runs on uvloop, as `kvfleet router serve`
does. Measured per round: the router process's own CPU time
(utime + stime from /proc) over the round, each request's time held (to its first token) and the
comments it got. CPU per held request is the round's router CPU / streams; the comments' cost is
the difference between the arms divided by the comments sent.

    .venv/bin/python bench/cold_start_hold.py                    # ~2 minutes
    .venv/bin/python bench/cold_start_hold.py --streams 200 --rounds 5

Writes docs/benchmarks/cold_start_hold.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
BACKEND = ROOT / "tests" / "router" / "backend.py"
MODEL = "m"


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up") from None
            time.sleep(0.05)


async def serve(port: int, backend_url: str, cold_s: float, comments: bool, interval_s: float) -> None:
    """The router under test: no replica until the first wake's cold start has passed."""
    from kvfleet.router.replicas import StaticReplicaSource
    from kvfleet.router.server import RouterServer
    from kvfleet.router.settings import RouterSettings
    from kvfleet.router.wake import InProcessWakeSignal
    from kvfleet.spec import RoutingSpec

    source = StaticReplicaSource()
    source.set_deployment(MODEL, routing=RoutingSpec(max_queue=100_000, max_queue_wait_seconds=600))
    woken: list[asyncio.Task[None]] = []

    async def ready_later() -> None:
        await asyncio.sleep(cold_s)
        source.add(MODEL, "r0", backend_url)

    def wake(namespace: str, name: str) -> None:
        if not woken:
            woken.append(asyncio.get_running_loop().create_task(ready_later()))

    settings = RouterSettings(
        port=port,
        cold_start_comments=comments,
        cold_start_comment_interval_s=interval_s,
        max_held_requests=100_000,
        max_client_connections_per_address=100_000,
    )
    server = RouterServer(settings, source, InProcessWakeSignal(wake))
    await server.start()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


async def one_stream(session: Any, url: str) -> tuple[float, int, bool]:
    """(seconds to the first token, comments received, whole stream received)."""
    body = {"model": MODEL, "prompt": "hi", "stream": True, "kvfleet_test": {"chunks": 2}}
    started = time.monotonic()
    first_s, comments, done = 0.0, 0, False
    async with session.post(url, json=body) as resp:
        async for raw in resp.content:
            if raw.startswith(b":"):
                comments += 1
            elif raw.startswith(b"data:"):
                if not first_s:
                    first_s = time.monotonic() - started
                done = raw.strip() == b"data: [DONE]"
    return first_s, comments, done


async def load(url: str, streams: int) -> list[tuple[float, int, bool]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one_stream(session, url) for _ in range(streams)))


def router_mean_held_s(url: str) -> float:
    """The router's own mean time held (arrival to a replica leased), from its hold histogram: apart from
    the load generator's delays in reading the streams."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"kvfleet_router_cold_start_hold_seconds_{part}{{"):
                values[part] = values.get(part, 0.0) + float(line.rsplit(" ", 1)[1])
    return values["sum"] / values["count"]


def one_round(args: argparse.Namespace, backend_url: str, comments: bool) -> dict[str, Any]:
    from kvfleet.free_port import pick_free_port

    port = pick_free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--backend-url", backend_url]
    cmd += ["--cold-s", str(args.cold_s), "--interval-s", str(args.interval_s)]
    cmd += ["--comments" if comments else "--no-comments"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        before = cpu_s(proc.pid)
        started = time.monotonic()
        results = asyncio.run(load(f"http://127.0.0.1:{port}/v1/completions", args.streams))
        wall_s = time.monotonic() - started
        used = cpu_s(proc.pid) - before
        router_held_s = router_mean_held_s(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    held = [r[0] for r in results]
    sent = [r[1] for r in results]
    return {
        "comments_on": comments,
        "streams": args.streams,
        "complete": sum(r[2] for r in results),
        "wall_s": round(wall_s, 3),
        "router_cpu_s": round(used, 4),
        "cpu_ms_per_held_request": round(used / args.streams * 1e3, 4),
        "held_s_median": round(statistics.median(held), 3),
        "router_held_s_mean": round(router_held_s, 3),
        "held_s_max": round(max(held), 3),
        "comments_per_request_median": statistics.median(sent),
        "comments_total": sum(sent),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(comments: bool, key: str) -> float:
        return float(statistics.median(r[key] for r in rounds if r["comments_on"] is comments))

    on_cpu, off_cpu = med(True, "cpu_ms_per_held_request"), med(False, "cpu_ms_per_held_request")
    comments_per = med(True, "comments_per_request_median")
    return {
        "held_s_median": {"on": med(True, "held_s_median"), "off": med(False, "held_s_median")},
        "router_held_s_mean": {"on": med(True, "router_held_s_mean"), "off": med(False, "router_held_s_mean")},
        "comments_per_request_median": comments_per,
        "cpu_ms_per_held_request_median": {"on": on_cpu, "off": off_cpu},
        "cpu_ratio_on_vs_off": round(on_cpu / off_cpu, 3) if off_cpu else None,
        "cpu_us_per_comment": round((on_cpu - off_cpu) * 1e3 / comments_per, 2) if comments_per else None,
    }


def write(result: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cold_start_hold.json").write_text(json.dumps(result, indent=2) + "\n")
    s, a = result["summary"], result["args"]
    lines = [
        "# Held through a cold start: the comments' cost",
        "",
        f"`bench/cold_start_hold.py --streams {a['streams']} --cold-s {a['cold_s']} --interval-s {a['interval_s']} "
        f"--rounds {a['rounds']}`: {a['streams']} streamed requests arrive at once at a model with no replica and are "
        f"held through a {a['cold_s']:g} s cold start, then served (a 2-chunk answer). The router is its own process; "
        "its CPU is its utime + stime over the round. Medians over the rounds of each arm, alternated in one run. "
        "This machine has 2 cores shared with other jobs: CPU times are the router process's own (other jobs do not "
        "add to them), wall times are not exact. Loopback, no proxy in between, no TLS: an easier shape than "
        "production, where the bytes also cross the network.",
        "",
        "| | today's hold (comments off) | comments on | ratio |",
        "|---|---|---|---|",
        f"| time held, median (s) | {s['held_s_median']['off']:.2f} | {s['held_s_median']['on']:.2f} | |",
        f"| time held, the router's own mean (s) | {s['router_held_s_mean']['off']:.2f} | "
        f"{s['router_held_s_mean']['on']:.2f} | |",
        f"| comments per request, median | 0 | {s['comments_per_request_median']:g} | |",
        f"| router CPU per held request (ms) | {s['cpu_ms_per_held_request_median']['off']:.3f} | "
        f"{s['cpu_ms_per_held_request_median']['on']:.3f} | {s['cpu_ratio_on_vs_off']}x |",
        f"| router CPU per comment (us) | | {s['cpu_us_per_comment']} | |",
        "",
        "Time held is each request's time to its first token as the load generator (one aiohttp process on the same "
        "cores) reads it: the cold start, then the replica's answer, then the generator's own delay in reading "
        "all the streams; the router's own mean is its hold histogram (arrival to a replica leased). Comments per "
        "request count every comment line the client received, the last (`replica ready after ...`) included. CPU "
        "per comment is (CPU per held request with comments - without) / comments per request; /proc counts CPU in "
        f"{1e3 / os.sysconf('SC_CLK_TCK'):g} ms ticks, so each round's figure is good to about one tick. At the "
        "router's default hold budget (max_held_requests 2000) and one comment a second, that is "
        f"{s['cpu_us_per_comment'] * 2000 / 1e6:.2f} of a core while 2000 streams are held."
        if s["cpu_us_per_comment"] is not None
        else "",
        "",
        "Per round:",
        "",
        "| comments | streams | complete | held median (s) | held max (s) | router's mean held (s) | comments/request "
        "| router CPU (s) | CPU/request (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rounds"]:
        lines.append(
            f"| {'on' if r['comments_on'] else 'off'} | {r['streams']} | {r['complete']} | {r['held_s_median']} | "
            f"{r['held_s_max']} | {r['router_held_s_mean']} | {r['comments_per_request_median']} | "
            f"{r['router_cpu_s']} | {r['cpu_ms_per_held_request']} |"
        )
    (OUT / "cold_start_hold.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--cold-s", type=float, default=10.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per arm")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backend-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--comments", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        from kvfleet.router.cli import run_event_loop

        async def main() -> int:
            await serve(args.serve, args.backend_url, args.cold_s, args.comments, args.interval_s)
            return 0

        run_event_loop(main())  # uvloop, as `kvfleet router serve` runs
        return
    from kvfleet.free_port import pick_free_port

    backend_port = pick_free_port()
    backend = subprocess.Popen(
        [sys.executable, str(BACKEND), "--port", str(backend_port), "--replica-id", "r0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        backend_url = f"http://127.0.0.1:{backend_port}"
        wait_http(backend_url + "/health")
        rounds = []
        for i in range(args.rounds * 2):
            row = one_round(args, backend_url, comments=i % 2 == 1)
            print(json.dumps(row), flush=True)
            rounds.append(row)
    finally:
        backend.terminate()
        backend.wait(timeout=10)
    result = {"args": vars(args) | {"serve": None}, "rounds": rounds, "summary": summarize(rounds)}
    print(json.dumps(result["summary"], indent=2))
    write(result)


if __name__ == "__main__":
    main()
