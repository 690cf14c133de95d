"""Real kvfleet components as local processes, for the live PromQL test.

Each runs through the real `kvfleet` CLI (`python -c "from kvfleet.cli import main; main()"`, so the
venv's interpreter is used), logs to a file, and is stopped with SIGTERM (then SIGKILL) at the end.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvfleet.free_port import pick_free_port
from kvfleet_testkit.kmock_resources import register_inference_deployments
from kvfleet_testkit.processes import stop_process

KVFLEET = [sys.executable, "-c", "from kvfleet.cli import main; main()"]


@dataclass
class Process:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        stop_process(self.proc)


def start(name: str, args: Sequence[str], url: str, log_dir: Path) -> Process:
    """Start ``kvfleet ARGS``; ``url`` is its base URL (for health checks and scraping)."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*KVFLEET, *args], stdout=out, stderr=subprocess.STDOUT)
    return Process(name, url, proc, log)


def wait_healthy(processes: Sequence[tuple[Process, str]], timeout_s: float) -> None:
    """Poll each (process, health path) until it answers 200; fail with its log if it dies or stalls."""
    deadline = time.monotonic() + timeout_s
    pending = list(processes)
    while pending:
        process, path = pending[0]
        try:
            with urllib.request.urlopen(process.url + path, timeout=2) as response:
                if response.status == 200:
                    pending.pop(0)
                    continue
        except OSError:
            pass
        if not process.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{process.name} did not become healthy on {path}:\n{process.tail()}")
        time.sleep(0.2)


@contextmanager
def stopping(processes: list[Process]) -> Iterator[list[Process]]:
    """Stop every process in the list (appended to while inside) on the way out, last started first."""
    try:
        yield processes
    finally:
        with ExitStack() as stack:
            for process in processes:
                stack.callback(process.stop)


@contextmanager
def hung_listener() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never answers: a hung replica."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])


def dead_port() -> int:
    """A loopback port nothing listens on (connections are refused): a crashed replica."""
    return pick_free_port()


def hold_request(router_url: str, model: str) -> socket.socket:
    """Send one chat request and leave the connection open without reading: the router holds it."""
    host, port = router_url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(head + body)
    return sock


@contextmanager
def kubernetes_api(port: int, objects: Sequence[tuple[str, dict[str, object]]]) -> Iterator[str]:
    """KMock (a real HTTP Kubernetes API emulator) on loopback, in a thread with its own event loop,
    holding ``objects`` (collection path, body). Yields its URL; stops it on the way out."""
    import asyncio
    import threading

    import aiohttp
    import kmock

    url = f"http://127.0.0.1:{port}"
    ready = threading.Event()
    failure: list[BaseException] = []
    loop_box: list[asyncio.AbstractEventLoop] = []
    stop_box: list[asyncio.Event] = []

    async def serve() -> None:
        k8s = kmock.KubernetesEmulator()
        register_inference_deployments(k8s)
        stop = asyncio.Event()
        loop_box.append(asyncio.get_running_loop())
        stop_box.append(stop)
        async with k8s, kmock.Server(k8s, port=port), aiohttp.ClientSession() as session:
            for path, body in objects:
                async with session.post(url + path, json=body) as response:
                    if response.status >= 300:
                        raise RuntimeError(f"POST {path}: {response.status} {await response.text()}")
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # reported to the test thread below
            failure.append(e)
            ready.set()

    thread = threading.Thread(target=run, name="kmock", daemon=True)
    thread.start()
    try:
        if not ready.wait(timeout=30) or failure:
            raise RuntimeError(f"KMock did not start: {failure!r}")
        yield url
    finally:
        if loop_box and stop_box:
            loop_box[0].call_soon_threadsafe(stop_box[0].set)
        thread.join(timeout=15)
