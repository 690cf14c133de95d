"""Requests held through a cold start, with real processes: the router in front of a backend process
(tests/router/backend.py) that a wake starts only after a delay, as the autoscaler and a cold engine
do; a real nginx (Debian) with ``proxy_read_timeout 2s`` in front for the proxy-timeout case; the
official ``openai`` client for the SDK case.

What is shown: a held stream gets SSE comments (the first at once, then every interval) that keep
nginx from timing it out over a 10 s cold start, and without them nginx answers 504; the comments
stop before the first token; a wake that times out ends a held stream with an error event and
[DONE]; a non-streamed request whose wake estimate exceeds its hold bound gets 503 with Retry-After
at once while the deployment still wakes; a client that leaves while held is no longer counted or
woken for; every held answer carries X-Kvfleet-Cold-Start."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvfleet.contracts import COLD_START_HEADER
from kvfleet.router.cold_start import ColdStart
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.wake import InProcessWakeSignal
from kvfleet.spec import RoutingSpec
from kvfleet_testkit.processes import stop_process
from tests.conftest import pick_free_port

from .conftest import Backend, running_router, start_backend, until

MODEL = "m"


class SlowWake:
    """The autoscaler's and the engine's part of a cold start: the first wake starts a real backend
    process after ``delay_s`` and adds it to every source (None: never); counts every wake. Given a
    ``ready`` backend (a process started before, to keep the suite short), it is added after the delay
    instead."""

    def __init__(
        self,
        sources: list[StaticReplicaSource],
        delay_s: float | None,
        replica_id: str = "cold0",
        ready: Backend | None = None,
    ) -> None:
        self.sources = sources
        self.delay_s = delay_s
        self.replica_id = ready.replica_id if ready is not None else replica_id
        self.calls = 0
        self.backend: Backend | None = None
        self._ready = ready
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, namespace: str, name: str) -> None:
        self.calls += 1
        if self._task is None and self.delay_s is not None:
            self._task = asyncio.get_running_loop().create_task(self._start(self.delay_s))

    async def _start(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.backend = self._ready or await asyncio.to_thread(start_backend, self.replica_id)
        for source in self.sources:
            source.add(MODEL, self.replica_id, self.backend.url)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.backend is not None and self._ready is None:
            self.backend.stop()


@pytest.fixture(scope="module")
def warm() -> Iterator[Backend]:
    """One backend process for the tests whose cold start is a delay before it is added."""
    backend = start_backend("warm0")
    try:
        yield backend
    finally:
        backend.stop()


def deployment(routing: RoutingSpec | None = None, cold: ColdStart | None = None) -> StaticReplicaSource:
    source = StaticReplicaSource()
    source.set_deployment(MODEL, routing=routing or RoutingSpec(max_queue_wait_seconds=60), cold_start=cold)
    return source


def completion(stream: bool, chunks: int = 4, delay_s: float = 0.0) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": chunks,
        "stream": stream,
        "kvfleet_test": {"chunks": chunks, "delay_s": delay_s},
    }


class Lines:
    """A stream as read: each line with the time (since the request) it arrived."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.lines: list[tuple[float, str]] = []

    @property
    def comments(self) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.lines if line.startswith(":")]

    @property
    def data(self) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.lines if line.startswith("data:")]

    def texts(self) -> list[str]:
        out = []
        for _, line in self.data:
            payload = line.removeprefix("data:").strip()
            if payload != "[DONE]":
                out.append(json.loads(payload)["choices"][0]["text"])
        return out


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Lines:
    got = Lines()
    started = time.monotonic()
    async with session.post(url, json=body) as resp:
        got.status = resp.status
        got.headers = dict(resp.headers)
        async for raw in resp.content:
            line = raw.decode().strip()
            if line:
                got.lines.append((time.monotonic() - started, line))
    return got


def metric(router: RouterServer, name: str, **labels: str) -> float:
    """One sample's value from the router's own /metrics text (0 when absent)."""
    text = router.metrics.render().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            sample, _, value = line.rpartition(" ")
            have = sample[len(name) :].strip("{}")
            if all(part in have.split(",") for part in wanted.split(",") if part):
                return float(value)
    return 0.0


# -- behind a real nginx -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        message = "nginx is not installed (scripts/bootstrap installs the Debian package)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@contextmanager
def nginx_in_front(binary: str, workdir: Path, routes: dict[str, int]) -> Iterator[str]:
    """nginx on a free loopback port, ``/<name>/`` proxied to each router port with the read timeout
    a proxy in front of kvfleet typically has (shortened from 60 s to 2 s), buffering off."""
    port = pick_free_port()
    user = "user root;\n" if os.geteuid() == 0 else ""
    locations = "".join(
        f"""    location /{name}/ {{
      proxy_pass http://127.0.0.1:{router_port}/;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 2s;
    }}
"""
        for name, router_port in routes.items()
    )
    conf = f"""{user}worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/body;
  proxy_temp_path {workdir}/proxy;
  fastcgi_temp_path {workdir}/fastcgi;
  uwsgi_temp_path {workdir}/uwsgi;
  scgi_temp_path {workdir}/scgi;
  server {{
    listen 127.0.0.1:{port};
    location = /health {{ return 200 "ok"; }}
{locations}  }}
}}
"""
    (workdir / "nginx.conf").write_text(conf)
    cmd = [binary, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            try:
                import urllib.request

                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nginx did not answer in 20 s") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, grace_s=10)


@pytest.mark.slow
@pytest.mark.e2e
async def test_behind_nginx_comments_carry_a_stream_through_a_10s_cold_start_and_without_them_it_gets_504(
    nginx_binary: str, tmp_path: Path
) -> None:
    # The same request through the same nginx to two routers, one with comments and one without,
    # sent at once: both wait on the one cold start (>= 10 s) the first wake begins.
    on, off = deployment(), deployment()
    wake = SlowWake([on, off], delay_s=10.0)
    signal = InProcessWakeSignal(wake)
    try:
        async with (
            running_router(on, wake=signal) as with_comments,
            running_router(off, wake=signal, cold_start_comments=False) as without,
        ):
            with nginx_in_front(nginx_binary, tmp_path, {"on": with_comments.port, "off": without.port}) as front:
                timeout = aiohttp.ClientTimeout(total=60)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    body = completion(stream=True, chunks=5)
                    kept, cut = await asyncio.gather(
                        read_stream(session, front + "/on/v1/completions", body),
                        read_stream(session, front + "/off/v1/completions", body),
                    )
    finally:
        await wake.close()
    # With comments: 200 and the whole stream, after the whole cold start.
    assert kept.status == 200, kept.lines
    assert kept.texts() == [f"w{i}" for i in range(5)]
    assert kept.data[-1][1] == "data: [DONE]"
    first_data_s = kept.data[0][0]
    assert first_data_s >= 10.0
    assert kept.headers[COLD_START_HEADER] == "0.000"  # the head went out with the first comment
    # The first comment at once, then about one a second (the machine is shared: loose bounds).
    assert kept.comments[0][0] < 1.0
    assert len(kept.comments) >= 9
    gaps = [b[0] - a[0] for a, b in zip(kept.comments, kept.comments[1:], strict=False)]
    assert max(gaps) < 2.0, gaps
    assert "cold start: " in kept.comments[0][1] and kept.comments[-1][1].startswith(": cold start: replica ready")
    # Without: nginx gives up after its 2 s read timeout, long before the replica is ready.
    assert cut.status == 504
    assert metric(with_comments, "kvfleet_router_cold_start_holds_total", outcome="served") == 1
    assert metric(with_comments, "kvfleet_router_cold_start_comments_total") == len(kept.comments) - 1
    assert metric(without, "kvfleet_router_cold_start_holds_total", outcome="client_gone") == 1


# -- the official SDK ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_the_openai_client_streams_through_a_held_cold_start(warm: Backend) -> None:
    source = deployment()
    wake = SlowWake([source], delay_s=1.5, ready=warm)
    try:
        async with running_router(source, wake=InProcessWakeSignal(wake), cold_start_comment_interval_s=0.2) as router:
            sdk = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="not-checked", max_retries=0, timeout=60)
            async with sdk:
                stream = await sdk.completions.create(
                    model=MODEL, prompt="hello", max_tokens=6, stream=True, extra_body={"kvfleet_test": {"chunks": 6}}
                )
                texts = [chunk.choices[0].text async for chunk in stream]
            comments = metric(router, "kvfleet_router_cold_start_comments_total")
    finally:
        await wake.close()
    assert texts == [f"w{i}" for i in range(6)]
    assert comments >= 5  # it was held: 1.5 s at 0.2 s per comment


async def test_the_openai_client_reads_the_503_of_a_model_still_starting() -> None:
    source = deployment(RoutingSpec(max_queue_wait_seconds=5), ColdStart(estimate_s=90.0))
    wake = SlowWake([source], delay_s=None)
    async with running_router(source, wake=InProcessWakeSignal(wake)) as router:
        sdk = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="not-checked", max_retries=0, timeout=10)
        async with sdk:
            with pytest.raises(openai.InternalServerError) as caught:
                await sdk.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        await until(lambda: wake.calls == 1)  # woken all the same
    assert caught.value.status_code == 503 and caught.value.code == "model_starting"
    assert caught.value.response.headers["Retry-After"] == "90"
    assert "about 1m30s" in caught.value.message


# -- non-streamed ---------------------------------------------------------------------------------


async def test_a_non_streamed_request_whose_wake_outlasts_its_hold_bound_gets_503_at_once_and_the_wake_goes_on(
    warm: Backend,
) -> None:
    # The deployment's cold start is 30 s; its requests may be held 5 s: holding would only time out.
    source = deployment(RoutingSpec(max_queue_wait_seconds=5), ColdStart(estimate_s=30.0))
    wake = SlowWake([source], delay_s=0.5, ready=warm)
    try:
        async with running_router(source, wake=InProcessWakeSignal(wake)) as router:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                started = time.monotonic()
                async with session.post(router.url + "/v1/completions", json=completion(stream=False)) as resp:
                    took_s = time.monotonic() - started
                    status, headers, error = resp.status, dict(resp.headers), (await resp.json())["error"]
                assert status == 503 and took_s < 1.0
                assert headers["Retry-After"] == "30" and headers[COLD_START_HEADER] == "0.000"
                assert error["type"] == error["code"] == "model_starting"
                assert "starting from zero replicas" in error["message"] and "about 30 s" in error["message"]
                # The deployment still wakes: the retry finds a replica.
                await until(lambda: router.fleet.inflight(MODEL) != {}, timeout_s=20)
                assert wake.calls == 1
                async with session.post(router.url + "/v1/completions", json=completion(stream=False)) as resp:
                    assert resp.status == 200 and COLD_START_HEADER not in resp.headers
            assert metric(router, "kvfleet_router_cold_start_holds_total", outcome="refused") == 1
    finally:
        await wake.close()


@pytest.mark.slow
async def test_a_held_non_streamed_answer_says_how_long_it_was_held(warm: Backend) -> None:
    source = deployment(cold=ColdStart(estimate_s=2.0))
    wake = SlowWake([source], delay_s=1.0, ready=warm)
    try:
        async with running_router(source, wake=InProcessWakeSignal(wake)) as router:
            async with (
                aiohttp.ClientSession() as session,
                session.post(router.url + "/v1/completions", json=completion(stream=False)) as resp,
            ):
                assert resp.status == 200
                held_s = float(resp.headers[COLD_START_HEADER])
                assert (await resp.json())["choices"][0]["text"] == "w0 w1 w2 w3"
            assert metric(router, "kvfleet_router_cold_start_comments_total") == 0
            assert metric(router, "kvfleet_router_cold_start_hold_seconds_count") == 1
    finally:
        await wake.close()
    assert held_s >= 1.0


# -- comments end where tokens begin; a client that leaves -----------------------------------------


@pytest.mark.slow
async def test_comments_stop_the_moment_the_first_token_is_sent(warm: Backend) -> None:
    source = deployment(cold=ColdStart(estimate_s=20.0))
    wake = SlowWake([source], delay_s=1.0, ready=warm)
    try:
        async with (
            running_router(source, wake=InProcessWakeSignal(wake), cold_start_comment_interval_s=0.1) as router,
            aiohttp.ClientSession() as session,
        ):
            # The replica takes 0.5 s to its first token, then tokens come 0.4 s apart; comments every 0.1 s:
            # any comment after the first token would show.
            body = completion(True, 4, delay_s=0.4)
            body["kvfleet_test"]["hold_s"] = 0.5
            got = await read_stream(session, router.url + "/v1/completions", body)
    finally:
        await wake.close()
    assert got.status == 200 and got.texts() == ["w0", "w1", "w2", "w3"]
    first_data = next(i for i, (_, line) in enumerate(got.lines) if line.startswith("data:"))
    assert all(line.startswith(":") for _, line in got.lines[:first_data])
    assert not any(line.startswith(":") for _, line in got.lines[first_data:])
    assert got.lines[first_data - 1][1].startswith(": cold start: replica ready after")
    # While the leased replica prepared its first token, the comments went on.
    waiting = [line for _, line in got.comments if "waiting for its first token" in line]
    assert len(waiting) >= 3, got.comments
    # Progress from the estimate: 20 s less the time waking so far.
    assert got.comments[0][1] == ": cold start: waking m, about 20 s left; held 0 s"
    assert len(got.comments) >= 8


async def test_a_client_that_leaves_while_held_is_no_longer_counted_or_woken_for() -> None:
    source = deployment()
    wake = SlowWake([source], delay_s=None)  # nothing ever starts
    async with (
        running_router(source, wake=InProcessWakeSignal(wake), wake_min_interval_s=0.1) as router,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(router.url + "/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b": cold start: waking m")
            await until(lambda: wake.calls >= 2)  # held, and woken for repeatedly
            assert router.fleet.queue_depth(MODEL) == 1
        # The client closed its connection.
        await until(lambda: router.fleet.queue_depth(MODEL) == 0, timeout_s=5)
        await until(lambda: metric(router, "kvfleet_router_cold_start_holds_total", outcome="client_gone") == 1)
        assert metric(router, "kvfleet_router_held_requests") == 0
        assert metric(router, "kvfleet_router_queue_depth", model=MODEL) == 0
        calls = wake.calls
        await asyncio.sleep(0.5)  # five wake intervals
        assert wake.calls == calls


async def test_a_held_stream_whose_wake_times_out_ends_with_an_error_event_and_done() -> None:
    source = deployment(RoutingSpec(max_queue_wait_seconds=0.5))
    wake = SlowWake([source], delay_s=None)
    async with running_router(source, wake=InProcessWakeSignal(wake), cold_start_comment_interval_s=0.1) as router:
        async with aiohttp.ClientSession() as session:
            got = await read_stream(session, router.url + "/v1/completions", completion(stream=True))
        assert metric(router, "kvfleet_router_cold_start_holds_total", outcome="timeout") == 1
    assert got.status == 200 and len(got.comments) >= 3
    assert [line for _, line in got.data][-1] == "data: [DONE]"
    error = json.loads(got.data[0][1].removeprefix("data:"))["error"]
    assert error["type"] == "no_replica_ready" and "maxQueueWaitSeconds" in error["message"]


async def test_a_held_stream_whose_replica_fails_before_answering_is_held_again_with_comments(warm: Backend) -> None:
    # The replica that came up fails the request (503 after 1 s) and meanwhile starts draining: the
    # retry finds no replica and is held again; the comments go on until the bound ends the stream.
    source = deployment(RoutingSpec(max_queue_wait_seconds=1.0))
    wake = SlowWake([source], delay_s=0.3, ready=warm)
    body = completion(stream=True) | {"kvfleet_test": {"hold_s": 1.0, "status": 503}}
    async with (
        running_router(source, wake=InProcessWakeSignal(wake), cold_start_comment_interval_s=0.1) as router,
        aiohttp.ClientSession() as session,
    ):
        reading = asyncio.ensure_future(read_stream(session, router.url + "/v1/completions", body))
        deadline = time.monotonic() + 20
        while (await asyncio.to_thread(warm.stats))["active"] < 1:
            assert time.monotonic() < deadline, "the replica never got the request"
            await asyncio.sleep(0.05)
        source.mark_draining(MODEL, warm.replica_id)
        got = await reading
        assert metric(router, "kvfleet_router_cold_start_holds_total", outcome="served") == 1
    assert got.status == 200
    # Comments went on while the replica held the request (0.3-1.3 s) and after its 503, until the
    # second hold's bound; no token ever came, so no "ready after" comment.
    assert got.comments[-1][0] > 1.5 and len(got.comments) >= 10
    assert any("waiting for its first token" in line for _, line in got.comments)
    assert not any(line.startswith(": cold start: replica ready after") for _, line in got.comments)
    error = json.loads(got.data[0][1].removeprefix("data:"))["error"]
    assert error["type"] == "no_replica_ready" and got.data[-1][1] == "data: [DONE]"


async def test_comments_off_holds_a_stream_silently_as_before(warm: Backend) -> None:
    source = deployment(cold=ColdStart(estimate_s=1.0))
    wake = SlowWake([source], delay_s=0.5, ready=warm)
    try:
        async with (
            running_router(source, wake=InProcessWakeSignal(wake), cold_start_comments=False) as router,
            aiohttp.ClientSession() as session,
        ):
            got = await read_stream(session, router.url + "/v1/completions", completion(stream=True))
    finally:
        await wake.close()
    assert got.status == 200 and got.comments == [] and got.texts() == ["w0", "w1", "w2", "w3"]
    assert float(got.headers[COLD_START_HEADER]) >= 0.5
