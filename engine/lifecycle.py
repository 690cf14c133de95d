"""The serving process's life: listen at once (``/health`` answers 503 while loading), load the model
on a worker thread, serve, and on SIGTERM/SIGINT drain -- refuse new work with 503, let in-flight
requests finish, exit 0; a second signal exits at once. The HTTP handlers live in ``server.py``."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.engine_core import EngineCore, load_engine_core
from kvfleet.engine.errors import EngineError
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.server import ServerState, create_app, start_site
from kvfleet.engine.settings import EngineSettings, ServerSettings


async def serve(model_dir: Path, engine_settings: EngineSettings, server_settings: ServerSettings) -> int:
    """Run until SIGTERM/SIGINT, then drain: refuse new work with 503, finish in-flight requests,
    return 0. A second signal exits at once."""
    served = server_settings.served_model_name or str(model_dir)
    metrics = EngineMetrics(served)
    state = ServerState(server_settings, served, metrics)
    runner, site = await start_site(create_app(state), server_settings)
    port = site.port
    print(f"kvfleet engine: listening on http://{server_settings.host}:{port} (loading {model_dir})", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            print(f"kvfleet engine: second signal {signum}; exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        print(f"kvfleet engine: signal {signum}; draining {state.in_flight} in-flight requests", flush=True)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    engine: AsyncEngine | None = None
    # Set on a stop while loading: a load waiting for shards a pull still fetches gives up at once.
    stopping = threading.Event()
    try:
        load: asyncio.Future[EngineCore] = loop.run_in_executor(
            None, functools.partial(load_engine_core, model_dir, engine_settings, served, metrics, stopping=stopping)
        )
        stopped: asyncio.Future[bool] = asyncio.ensure_future(stop.wait())
        waiters: list[asyncio.Future[Any]] = [load, stopped]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            stopped.cancel()
            stopping.set()
            return 0  # stopped while loading: nothing in flight to drain
        stopped.cancel()
        try:
            core = load.result()
        except EngineError as e:
            print(f"kvfleet engine: cannot serve {model_dir}: {e}", file=sys.stderr, flush=True)
            return 1
        engine = AsyncEngine(
            core, max_waiting_requests=engine_settings.max_waiting_requests, retry_after_s=server_settings.retry_after_s
        )
        engine.start()
        state.engine = engine
        print(
            f"kvfleet engine: ready: {served} on {core.model.device}, {core.num_blocks} KV blocks of "
            f"{engine_settings.block_size_tokens} tokens",
            flush=True,
        )
        await stop.wait()
        state.draining = True
        metrics.draining.labels(served).set(1)
        try:
            await asyncio.wait_for(state.idle.wait(), timeout=server_settings.drain_timeout_s)
        except TimeoutError:
            print(f"kvfleet engine: drain timed out with {state.in_flight} requests in flight", file=sys.stderr)
        return 0
    finally:
        await runner.cleanup()
        if engine is not None:
            engine.shutdown()
