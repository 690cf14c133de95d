"""Router test fixtures: real backend processes (tests/router/backend.py) and a router on a free port."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfleet.router.replicas import ReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import NoWakeSignal, WakeSignal
from kvfleet_testkit.engines import Engine, start_engine
from tests.conftest import pick_free_port

BACKEND = Path(__file__).with_name("backend.py")


@contextmanager
def running_engines(
    model_dir: Path, count: int, log_dir: Path, served: str, *args: str, prefix: str = "e"
) -> Iterator[list[Engine]]:
    """``count`` reference engines (``<prefix>0``, ...) serving ``served`` with ``args``; every one started
    is stopped when the block ends, also when a later one fails to start."""
    started: list[Engine] = []
    try:
        for i in range(count):
            started.append(start_engine(model_dir, f"{prefix}{i}", log_dir, served, *args))
        yield started
    finally:
        for engine in started:
            engine.stop()


@dataclass
class Backend:
    replica_id: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stats", timeout=5) as resp:
            return dict(json.loads(resp.read()))

    def kill(self) -> None:
        """SIGKILL: the process dies with whatever it had in flight."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_backend(replica_id: str) -> Backend:
    port = pick_free_port()
    proc = subprocess.Popen(
        [sys.executable, str(BACKEND), "--port", str(port), "--replica-id", replica_id],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    backend = Backend(replica_id, port, proc)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"backend {replica_id} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(backend.url + "/health", timeout=1):
                return backend
        except OSError:
            time.sleep(0.05)
    backend.stop()
    raise RuntimeError(f"backend {replica_id} did not become healthy in 20 s")


@pytest.fixture(scope="session")
def backends() -> Iterator[list[Backend]]:
    """Four long-lived replicas shared by tests that do not kill or drain them."""
    started = [start_backend(f"r{i}") for i in range(4)]
    try:
        yield started
    finally:
        for backend in started:
            backend.stop()


@pytest.fixture
def spawn_backend() -> Iterator[Callable[[str], Backend]]:
    """Replicas a test may kill or drain; all stopped at the end."""
    started: list[Backend] = []

    def spawn(replica_id: str) -> Backend:
        backend = start_backend(replica_id)
        started.append(backend)
        return backend

    try:
        yield spawn
    finally:
        for backend in started:
            backend.stop()


@asynccontextmanager
async def running_router(
    source: ReplicaSource, *, wake: WakeSignal | None = None, **overrides: Any
) -> AsyncIterator[RouterServer]:
    settings = RouterSettings(port=0, **overrides)
    server = RouterServer(settings, source, wake or NoWakeSignal())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s`` (never wait unbounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)


def route_as_the_proxy(fleet: Any, body: dict[str, object], model: str = "m") -> tuple[str, list[int] | None]:
    """Route ``body`` as the proxy does (text blocks, the tokenizing job, a lease released at once): the
    replica picked and the engine blocks the prompt was tokenized into (None: not tokenized)."""
    from kvfleet.router.prompt import block_hashes, render_prompt

    hashes = block_hashes(render_prompt(body), model=model, block_chars=16, max_blocks=1000)
    tokenize = fleet.engine_blocks_job(model, dict(body), hashes)
    if tokenize is not None:
        tokenize()
    lease = fleet.try_acquire(model, hashes)
    assert lease is not None
    lease.release("ok")
    return lease.replica_id, hashes.engine_blocks


@pytest.fixture
def publishers() -> Iterator[list[Any]]:
    """Two KV-event publishers on free ports (support/event_publisher.py), closed after the test."""
    from support.event_publisher import Publisher

    made = [Publisher(pick_free_port()) for _ in range(2)]
    yield made
    for p in made:
        p.close()
