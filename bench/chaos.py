"""Chaos benchmark: no request lost while replicas die, scale down and roll.

Local mode's parts in one process: the router (RouterServer) and local mode's process actuator
(DeploymentProcesses, which replaces a dead engine and drains one it stops) over 3 real
reference-engine processes serving a tiny random-weight model. A mixed load (chat and completions,
streamed and not, temperature 0) runs at a fixed concurrency while the run ``kill -9``s a ready
replica at 5 random moments, scales down to 2 (and back to 3) once and does one rolling restart.

Run twice on the same seed: with stream migration (kvfleet) and without it (the baseline: a broken
stream ends with an error event). Counts sent, complete, migrated, failed with reason; the added
time to the next token of migrated streams (router-measured, from the break to the continuation's
first byte); whether a migrated temperature-0 stream's text equals an unbroken run of the same
request. A last phase measures the router process's memory while 500 connections each hold a head
just under the size limit.

    .venv/bin/python bench/chaos.py [--requests 2000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet.autoscaler.engine_metrics import scrape_engine, total_inflight
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.free_port import pick_free_port
from kvfleet.local.actuator import DeploymentProcesses
from kvfleet.local.models import EngineLaunch
from kvfleet.local.routing import RouterRegistry
from kvfleet.local.settings import ProcessSettings
from kvfleet.router.migration import CHAT_PATH, continuation, progress
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import InferenceDeploymentSpec

SERVED = "tiny"
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
VLLM_PROCESS = ProcessSettings(ready_timeout_s=900, drain_wait_s=60, term_grace_s=30)
PROCESS = ProcessSettings(
    ready_timeout_s=120,
    health_poll_interval_s=0.05,
    drain_wait_s=60,
    term_grace_s=30,
    restart_backoff_initial_s=0.5,
    restart_backoff_max_s=2.0,
)


@dataclass
class Outcome:
    kind: str  # chat / completions
    stream: bool
    status: int = 0
    complete: bool = False
    reason: str = ""
    response_id: str = ""
    text: str = ""
    body: dict[str, Any] = field(default_factory=dict)


def make_body(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    common: dict[str, Any] = {
        "model": SERVED,
        "max_tokens": rng.randint(24, 96),
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        common["stream_options"] = {"include_usage": True}
    topic = rng.choice(["routers", "caches", "GPUs", "autoscaling", "queues"])
    if chat:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Say {i} on {topic}."}]}
    return "/v1/completions", {**common, "prompt": f"Request {i} about {topic}:"}


async def send(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> Outcome:
    chat = path.endswith("chat/completions")
    out = Outcome("chat" if chat else "completions", bool(body["stream"]), body=body)
    try:
        async with session.post(url + path, json=body) as resp:
            out.status = resp.status
            raw = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        out.reason = f"client error: {type(e).__name__}"
        return out
    if out.status != 200:
        out.reason = f"HTTP {out.status}: {raw[:120]!r}"
        return out
    if not out.stream:
        try:
            obj = json.loads(raw)
            choice = obj["choices"][0]
            out.text = choice["message"]["content"] if chat else choice["text"]
            out.complete = bool(choice["finish_reason"]) and obj["usage"]["completion_tokens"] == body["max_tokens"]
            out.response_id = obj["id"]
        except (ValueError, KeyError, IndexError) as e:
            out.reason = f"bad JSON body: {e}"
        return out
    events = [e.removeprefix("data: ") for e in raw.decode(errors="replace").split("\n\n") if e.strip()]
    if not events or events[-1] != "[DONE]":
        out.reason = "truncated: no [DONE]"
        return out
    parts, finish, usage = [], None, None
    for event in events[:-1]:
        obj = json.loads(event)
        if "error" in obj:
            out.reason = f"error event: {obj['error']['message'][:100]}"
            return out
        out.response_id = out.response_id or obj.get("id", "")
        usage = obj.get("usage") or usage
        for choice in obj.get("choices", []):
            parts.append((choice.get("delta", {}).get("content") if chat else choice.get("text")) or "")
            finish = choice.get("finish_reason") or finish
    out.text = "".join(parts)
    out.complete = finish is not None and usage is not None and usage["completion_tokens"] == body["max_tokens"]
    if not out.complete:
        out.reason = f"incomplete: finish={finish} usage={usage}"
    return out


class MigrationLog(logging.Handler):
    """The router's migration log records (stream id, gap): which streams moved and how long it took."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.gaps: dict[str, float] = {}
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        stream_id = getattr(record, "stream_id", None)
        if stream_id is not None:
            self.gaps[stream_id] = float(getattr(record, "gap_s", 0.0))
        elif "could not be continued" in record.getMessage():
            self.failures.append(record.getMessage()[:200])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def vllm_launch(model: Path) -> EngineLaunch:
    """vLLM's CPU build as local mode runs it (the launcher's own command, ``render_vllm``), eager,
    small batches for 2 cores; the same settings as tests/vllm."""
    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"uri": f"file://{model}"},
            "engine": {
                "kind": "vllm",
                "maxModelLen": 512,
                "dtype": "float32",
                "extraArgs": ["--enforce-eager", "--block-size", "32", "--max-num-seqs", "8"],
            },
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
            "routing": {"kvEvents": {"enabled": False}},
        }
    )
    return EngineLaunch(SERVED, SERVED, model, (), {}, vllm_spec=spec, drain_timeout_s=30)


async def chaos_run(model: Path, logs: Path, args: argparse.Namespace, migrate: bool) -> dict[str, Any]:
    rng = random.Random(args.seed)
    settings = RouterSettings(port=0, stream_migration_attempts=3 if migrate else 0)
    source = StaticReplicaSource()
    router = RouterServer(settings, source, NoWakeSignal())
    await router.start()
    handler = MigrationLog()
    logging.getLogger("kvfleet.router.proxy").addHandler(handler)
    vllm = args.engine == "vllm"
    launch = (
        vllm_launch(model)
        if vllm
        else EngineLaunch(SERVED, SERVED, model, ("--threads", "1", "--kv-blocks", "512"), {})
    )
    # vLLM starts in minutes here: two replicas and kills only (no scale-down or rolling restart).
    replicas = 2 if vllm else 3
    events: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def engine_inflight(url: str) -> int:
            return total_inflight([await scrape_engine(session, url)])

        registry = RouterRegistry(source, {SERVED: SERVED}, router.fleet.inflight)
        procs = DeploymentProcesses(
            name=SERVED,
            command=launch.argv,
            registry=registry,
            settings=VLLM_PROCESS if vllm else PROCESS,
            session=session,
            log_dir=logs / ("kvfleet" if migrate else "baseline"),
            max_replicas=4,
            engine_inflight=engine_inflight,
        )
        loop_task = asyncio.create_task(procs.run(poll_interval_s=0.2))
        procs.set_desired(replicas, "bench")
        while procs.count("ready") < replicas:  # noqa: ASYNC110 - the actuator has no readiness event to await
            await asyncio.sleep(0.1)
        n = args.requests
        # Chaos planned at request counts, each done at the first request from its mark on where it
        # applies: a kill only while another replica is ready (the goal is "no failure while at least
        # one replica lives"), the scale-down and the rolling restart only with 3 ready.
        plan = ["kill"] * args.kills + ([] if vllm else ["scale-down", "scale-up", "roll"])
        marks = sorted(rng.sample(range(n // 20, n * 3 // 4), len(plan)))
        rng.shuffle(plan)
        if not vllm and plan.index("scale-up") < plan.index("scale-down"):
            a, b = plan.index("scale-up"), plan.index("scale-down")
            plan[a], plan[b] = plan[b], plan[a]
        todo = list(zip(marks, plan, strict=True))
        bodies = [make_body(rng, i) for i in range(n)]
        outcomes: list[Outcome] = []
        started = 0
        background: list[asyncio.Task[None]] = []
        killed: set[int] = set()
        killed_ids: set[str] = set()
        t0 = time.monotonic()

        def chaos(at: int) -> None:
            if not todo or todo[0][0] > at:
                return
            action = todo[0][1]
            # A replica killed a moment ago can still read as ready until the actuator sees it exit.
            ready = [s for s in procs.snapshot() if s.state == "ready" and s.pid and s.pid not in killed]
            rolling = any(not t.done() for t in background)
            now = f"{time.monotonic() - t0:6.1f}s #{at}"
            if action == "kill" and len(ready) >= 2:
                victim = rng.choice(ready)
                assert victim.pid is not None
                # vLLM: the whole engine (API server, engine core, worker: the replica's process group).
                (os.killpg if vllm else os.kill)(victim.pid, signal.SIGKILL)
                killed.add(victim.pid)
                killed_ids.add(victim.replica_id)
                events.append(f"{now} kill -9 {victim.replica_id} ({len(ready)} ready)")
            elif action == "scale-down" and len(ready) == 3 and not rolling:
                procs.set_desired(2, "bench scale-down")
                events.append(f"{now} scale down to 2")
            elif action == "scale-up":
                procs.set_desired(3, "bench scale-up")
                events.append(f"{now} scale up to 3")
            elif action == "roll" and len(ready) == 3 and procs.desired == 3 and not rolling:
                events.append(f"{now} rolling restart")
                background.append(asyncio.create_task(procs.rolling_restart("bench")))
            else:
                return
            todo.pop(0)

        extra_rng = random.Random(args.seed + 1)

        async def worker() -> None:
            # Past ``n`` requests the load goes on while planned chaos is still waiting for its moment
            # (replicas restart slowly on a loaded machine), up to --max-duration-s.
            nonlocal started
            while started < n or (todo and time.monotonic() - t0 < args.max_duration_s):
                i = started
                started += 1
                chaos(i)
                path, body = bodies[i] if i < n else make_body(extra_rng, i)
                outcomes.append(await send(session, router.url, path, body))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed_s = time.monotonic() - t0
        for task in background:
            await task
        # Text equality: each migrated stream again, unbroken, on a calm fleet.
        migrated = [o for o in outcomes if o.response_id in handler.gaps]
        same = 0
        for o in migrated:
            path = "/v1/chat/completions" if o.kind == "chat" else "/v1/completions"
            again = await send(session, router.url, path, o.body)
            same += again.complete and again.text == o.text
        procs_events = list(procs.events)
        await procs.shutdown()
        loop_task.cancel()
    logging.getLogger("kvfleet.router.proxy").removeHandler(handler)
    metrics = router.metrics.render().decode()
    await router.stop()
    failed = Counter(o.reason.split(":")[0] for o in outcomes if not o.complete)
    gaps = list(handler.gaps.values())
    return {
        "migration": migrate,
        "sent": len(outcomes),
        "complete": sum(o.complete for o in outcomes),
        "streamed": sum(o.stream for o in outcomes),
        "migrated": len(migrated),
        "failed": sum(not o.complete for o in outcomes),
        "failed_by_reason": dict(failed),
        # A failure that names no killed replica came from a drain (scale-down, rolling restart).
        "failed_not_on_a_killed_replica": sum(
            not o.complete and not any(f"replica {r} " in o.reason for r in killed_ids) for o in outcomes
        ),
        "failure_examples": sorted({o.reason for o in outcomes if not o.complete})[:8],
        "migration_failures": handler.failures[:5],
        "added_ttft_p50_s": pct(gaps, 0.5),
        "added_ttft_p99_s": pct(gaps, 0.99),
        "migrated_text_equal_unbroken": same,
        "elapsed_s": round(elapsed_s, 1),
        "requests_per_s": round(len(outcomes) / elapsed_s, 1),
        "chaos": events,
        "chaos_not_done": [f"#{at} {action}" for at, action in todo],
        "actuator_events": procs_events[-30:],
        "retries_metric": sum(
            float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kvfleet_router_retries_total")
        ),
    }


async def start_engine_process(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = pick_free_port()
    argv = EngineLaunch("eq", SERVED, model, ("--threads", "1", "--kv-blocks", "256"), {}).argv(port)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)  # noqa: ASYNC220 - started once
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(1200):
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"engine did not start, see {log}")


async def continuation_equality(model: Path, log: Path, requests: int, seed: int) -> dict[str, Any]:
    """Break streams at chosen points without killing anything: the router's own continuation request
    (router/migration.py) built from the events sent so far, answered by the engine, appended to the
    text sent, compared with the unbroken temperature-0 text. Differences are classed by cause."""
    rng = random.Random(seed)
    proc, url = await start_engine_process(model, log)
    counts: Counter[str] = Counter()
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(requests):
                path, body = make_body(rng, i)
                chat = path == CHAT_PATH
                body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                async with session.post(url + path, json=body) as resp:
                    raw = await resp.read()
                events = [e for e in raw.split(b"\n\n") if e.strip()]
                full = progress(raw, chat=chat).text
                content_at = [j for j, e in enumerate(events) if progress(e + b"\n\n", chat=chat).chunks]
                for k in sorted({3, len(content_at) // 3, 2 * len(content_at) // 3}):
                    cut = b"\n\n".join(events[: content_at[k] + 1]) + b"\n\n"
                    sent = progress(cut, chat=chat)
                    follow = continuation(path, {**body, "stream": False, "stream_options": None}, sent)
                    assert follow.body is not None, follow.reason
                    follow.body.pop("stream_options")
                    async with session.post(url + path, json=follow.body) as resp:
                        choice = (await resp.json())["choices"][0]
                    text = sent.text + (choice["message"]["content"] if chat else choice["text"])
                    counts["breaks"] += 1
                    if text == full:
                        counts["equal"] += 1
                    elif "\ufffd" in sent.text:
                        counts["differ: a byte fragment (U+FFFD) in the text sent"] += 1
                    else:
                        counts["differ: the text sent re-tokenizes differently"] += 1
    finally:
        proc.kill()
        proc.wait()
    return dict(counts)


ROUTER_PROC = """
import asyncio, sys
from kvfleet.router.migration import CHAT_PATH, continuation, progress
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal
from kvfleet.spec import InferenceDeploymentSpec
async def main():
    server = RouterServer(RouterSettings(port=0), StaticReplicaSource(), NoWakeSignal())
    await server.start()
    print(server.port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def head_memory(connections: int) -> dict[str, Any]:
    """The router process's RSS while ``connections`` clients each hold a head just under the limit."""
    limit = RouterSettings().max_request_head_bytes
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", ROUTER_PROC, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(await proc.stdout.readline())
        await asyncio.sleep(0.5)
        idle = rss_mib(proc.pid)
        held = []
        head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (limit - 64)  # unfinished: no final CRLF
        for _ in range(connections):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            held.append((reader, writer))
        for _, writer in held:
            await writer.drain()
        await asyncio.sleep(1.0)
        peak = rss_mib(proc.pid)
        # Over the limit: each is answered 431 and closed, so memory does not grow with the attempt.
        over = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (4 * limit)
        refused = 0
        for _ in range(100):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(over)
            try:
                answer = await asyncio.wait_for(reader.read(64), 5)
                refused += answer.startswith(b"HTTP/1.1 431")
            except (ConnectionError, TimeoutError):
                pass
            writer.close()
        after_over = rss_mib(proc.pid)
        for _, writer in held:
            writer.close()
        return {
            "connections": connections,
            "head_bytes_each": len(head),
            "max_request_head_bytes": limit,
            "rss_idle_mib": round(idle, 1),
            "rss_holding_mib": round(peak, 1),
            "rss_per_connection_kib": round((peak - idle) * 1024 / connections, 1),
            "over_limit_refused_431": refused,
            "rss_after_100_over_limit_mib": round(after_over, 1),
            "bound_mib": round(connections * (limit + 256 * 1024) / 2**20, 1),
        }
    finally:
        proc.kill()
        await proc.wait()


def render_markdown(result: dict[str, Any]) -> str:
    k, b, m = result["kvfleet"], result["baseline_no_migration"], result["front_end_memory"]
    eq = result["continuation_equality"]

    def equality(name: str) -> str:
        counts = eq[name]
        differ = ", ".join(f"{c} {r.removeprefix('differ: ')}" for r, c in counts.items() if r.startswith("differ"))
        return f"{counts.get('equal', 0)} of {counts['breaks']} equal" + (f"; differ: {differ}" if differ else "")

    def row(name: str, key: str) -> str:
        return f"| {name} | {k[key]} | {b[key]} |"

    def reasons(run: dict[str, Any]) -> str:
        return ", ".join(f"{r}: {c}" for r, c in run["failed_by_reason"].items()) or "none"

    lines = [
        "# Chaos benchmark: replicas killed, scaled down and rolled under load",
        "",
        f"Command: `{result['command']}` ({result['machine']}; the engines, the router and the client share",
        "the cores). Local mode's parts: the router and local mode's process actuator over 3 reference-engine",
        "processes (tiny random-weight model that generates whole words only, see below; 1 torch thread",
        "each); a mixed load (chat and completions,",
        "streamed and not, temperature 0, 24-96 tokens each) at concurrency 16; `kill -9` of a ready replica",
        "at 5 random moments (only while another replica is ready), one scale-down to 2 and back to 3, one",
        "rolling restart (maxSurge 1). The same seed and chaos plan run without stream migration as the",
        "baseline (what the router did before: a broken stream ends with an error event).",
        "",
        "| | kvfleet (migration on) | baseline (migration off) |",
        "|---|---|---|",
        row("requests sent", "sent"),
        row("of them streamed", "streamed"),
        row("answered complete", "complete"),
        row("streams migrated to another replica", "migrated"),
        row("failed", "failed"),
        f"| failed, by reason | {reasons(k)} | {reasons(b)} |",
        row("failed on a replica not killed (a drain: scale-down, rolling restart)", "failed_not_on_a_killed_replica"),
        f"| added time to next token of a migrated stream, p50 / p99 (s) | {k['added_ttft_p50_s']:.3f} / "
        f"{k['added_ttft_p99_s']:.3f} | - |",
        f"| migrated temperature-0 texts equal to an unbroken run | {k['migrated_text_equal_unbroken']} of "
        f"{k['migrated']} | - |",
        row("retries before the first byte (metric)", "retries_metric"),
        row("run time (s)", "elapsed_s"),
        "",
        "Chaos as it happened (kvfleet run): " + "; ".join(k["chaos"]) + ".",
        (f" Not done (no moment where it applied): {', '.join(k['chaos_not_done'])}." if k["chaos_not_done"] else ""),
        "",
        "Added time to next token: from the router seeing the break to the continuation's first byte",
        "(router-measured; connect, the continuation's prefill of prompt plus text so far, first token).",
        "",
        "Text equality: a migrated stream is sent again, unbroken, after the run and the texts compared.",
        "Greedy decoding continues identically where the text sent re-tokenizes into the tokens that were",
        "generated. The chaos runs' model generates whole space-led words only (`make-tiny-model",
        "--words-only`), whose text always re-tokenizes exactly, as a real model's text nearly always does.",
        "",
        "Where token boundaries can shift: each of "
        f"{eq['byte_level']['breaks'] // 3} streamed requests broken at 3 points (the router's own",
        "continuation request, built from the events sent so far, answered by one engine) and compared with",
        "the unbroken text:",
        "",
        "| model | continuations equal to the unbroken text |",
        "|---|---|",
        f"| words only (the chaos runs' model) | {equality('words_only')} |",
        f"| byte-level, any token (random weights) | {equality('byte_level')} |",
        "",
        "The byte-level model with random weights emits byte fragments (invalid UTF-8, sent to the client",
        "as U+FFFD, which re-encodes as other tokens) and token sequences that BPE merges differently when",
        "the text is encoded again; the continuation then sees other tokens and greedy decoding goes",
        "elsewhere. A trained model rarely does either. Exact continuation for any text needs the token",
        "ids (vLLM's `return_token_ids`), which the router does not ask for.",
        "",
        "## Front-end memory",
        "",
        f"A router process (no replicas) while {m['connections']} connections each hold an unfinished head of",
        f"{m['head_bytes_each']} bytes (the limit is {m['max_request_head_bytes']}):",
        "",
        "| | value |",
        "|---|---|",
        f"| RSS idle | {m['rss_idle_mib']} MiB |",
        f"| RSS holding {m['connections']} maximum-size heads | {m['rss_holding_mib']} MiB |",
        f"| per connection | {m['rss_per_connection_kib']} KiB |",
        f"| stated bound (connections x (limit + one 256 KiB read)) | {m['bound_mib']} MiB |",
        f"| 100 heads 4x over the limit: answered 431 | {m['over_limit_refused_431']} of 100 |",
        f"| RSS after them | {m['rss_after_100_over_limit_mib']} MiB |",
        "",
        "Results: [chaos.json](chaos.json).",
        "",
    ]
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--baseline-requests", type=int, default=0, help="0: the same as --requests")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--equality-requests", type=int, default=40, help="streams broken at 3 points each")
    parser.add_argument("--max-duration-s", type=float, default=600, help="cap on a run that waits for its chaos")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--render", action="store_true", help="only rewrite chaos.md from chaos.json")
    parser.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="vllm: two replicas of vLLM's CPU build, kills only, stream migration on; to chaos_vllm.{json,md}",
    )
    parser.add_argument("--kills", type=int, default=5, help="kill -9 of a ready replica, at random moments")
    args = parser.parse_args()
    if args.engine == "vllm":
        await vllm_main(args)
        return
    if args.render:
        result = json.loads((args.out / "chaos.json").read_text())
        (args.out / "chaos.md").write_text(render_markdown(result))
        return
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().handlers[0].setLevel(logging.WARNING)
    logging.getLogger("kvfleet.router.proxy").setLevel(logging.INFO)  # the migration records
    with tempfile.TemporaryDirectory() as tmp:
        # Words only: the chaos runs' texts re-tokenize exactly, so a migrated text must equal the
        # unbroken one; the byte-level model shows how often continuations differ when they do not.
        model = make_tiny_model(Path(tmp) / "words", layers=2, hidden=64, vocab=1024, words_only=True)
        byte_level = make_tiny_model(Path(tmp) / "bytes", layers=2, hidden=64, vocab=1024)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        equality = {
            name: await continuation_equality(m, logs / f"eq-{name}.log", args.equality_requests, args.seed)
            for name, m in (("words_only", model), ("byte_level", byte_level))
        }
        print(json.dumps(equality, indent=1), flush=True)
        kvfleet = await chaos_run(model, logs, args, migrate=True)
        print(json.dumps(kvfleet, indent=1), flush=True)
        base_args = argparse.Namespace(**{**vars(args), "requests": args.baseline_requests or args.requests})
        baseline = await chaos_run(model, logs, base_args, migrate=False)
        print(json.dumps(baseline, indent=1), flush=True)
    memory = await head_memory(args.connections)
    print(json.dumps(memory, indent=1))
    result = {
        "machine": f"{os.cpu_count()} CPUs, shared",
        "command": " ".join(["bench/chaos.py", *sys.argv[1:]]),
        "kvfleet": kvfleet,
        "baseline_no_migration": baseline,
        "continuation_equality": equality,
        "front_end_memory": memory,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "chaos.md").write_text(render_markdown(result))
    print(f"wrote {args.out / 'chaos.json'} and chaos.md")


async def vllm_main(args: argparse.Namespace) -> None:
    """The chaos run with vLLM replicas: is any stream cut?"""
    from kvfleet.local.models import VLLM_TINY_MODEL

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kvfleet.router.proxy").setLevel(logging.INFO)
    load_before = [round(x, 1) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "words", words_only=True, **VLLM_TINY_MODEL)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        run = await chaos_run(model, logs, args, migrate=True)
    print(json.dumps(run, indent=1), flush=True)
    result = {
        "machine": f"{os.cpu_count()} CPUs, shared",
        "load_before": load_before,
        "load_after": [round(x, 1) for x in os.getloadavg()],
        "command": " ".join(["bench/chaos.py", *sys.argv[1:]]),
        "vllm": run,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos_vllm.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "chaos_vllm.md").write_text(render_vllm_markdown(result))
    print(f"wrote {args.out / 'chaos_vllm.json'} and chaos_vllm.md")


def render_vllm_markdown(result: dict[str, Any]) -> str:
    run = result["vllm"]
    reasons = ", ".join(f"{r}: {c}" for r, c in run["failed_by_reason"].items()) or "none"
    return "\n".join(
        [
            "# Chaos benchmark with vLLM replicas",
            "",
            f"Command: `{result['command']}` ({result['machine']}, load average {result['load_before']} before, "
            f"{result['load_after']} after: a busy machine). The router and local mode's process actuator over two "
            "replicas of vLLM 0.32.0's CPU build (the launcher's command, eager, the tiny whole-words model); a mixed "
            "load (chat and completions, streamed and not, temperature 0, 24-96 tokens); `kill -9` of a ready "
            "replica's whole process group while the other is ready; stream migration on. No baseline run and no "
            "scale-down or rolling restart here (a vLLM start takes minutes on this machine): bench/chaos.py "
            "without --engine has those, on the reference engine.",
            "",
            "| | |",
            "|---|---|",
            f"| sent | {run['sent']} (streamed {run['streamed']}) |",
            f"| complete (every token, `[DONE]`) | {run['complete']} |",
            f"| failed | {run['failed']} ({reasons}) |",
            f"| migrated streams | {run['migrated']} |",
            f"| added time to next token of a migrated stream, p50 / p99 | "
            f"{run['added_ttft_p50_s'] * 1e3:.0f} / {run['added_ttft_p99_s'] * 1e3:.0f} ms |",
            f"| migrated text equal to an unbroken run | {run['migrated_text_equal_unbroken']} of {run['migrated']} |",
            f"| chaos | {'; '.join(run['chaos']) or 'none'} |",
            f"| chaos not done | {', '.join(run['chaos_not_done']) or 'none'} |",
            "",
        ]
    )


if __name__ == "__main__":
    asyncio.run(main())
