"""Wait for a started engine to become ready, then serve one token through it.

``/health`` answering 200 ends the engine_start phase; a one-token completion ends first_ready,
so the cold start is measured to the first token a client could get, which is what a user of a
scaled-from-zero deployment waits for. Both waits are bounded and give up at once if the engine
process exits (that is a failed launch, not something to keep polling).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from .errors import EngineExitedError, LaunchError, Phase
from .supervisor import EngineProcess


@dataclass(frozen=True)
class ReadinessSettings:
    """Bounds on waiting for the engine. vLLM loading a 70B model can take many minutes."""

    ready_timeout_s: float = 1800.0
    poll_interval_s: float = 0.25
    request_timeout_s: float = 5.0
    first_token_timeout_s: float = 300.0
    warmup_prompt: str = "Hello"

    def __post_init__(self) -> None:
        if not 0 < self.ready_timeout_s <= 7200:
            raise ValueError("ready_timeout_s must be in (0, 7200]")
        if not 0 < self.poll_interval_s <= 10:
            raise ValueError("poll_interval_s must be in (0, 10]")
        if not 0 < self.request_timeout_s <= 60:
            raise ValueError("request_timeout_s must be in (0, 60]")
        if not 0 < self.first_token_timeout_s <= 3600:
            raise ValueError("first_token_timeout_s must be in (0, 3600]")


async def _race_engine_exit(engine: EngineProcess, phase: Phase, work: Awaitable[Any], timeout_s: float) -> Any:
    """Run ``work`` unless the engine exits first or ``timeout_s`` passes."""
    work_task = asyncio.ensure_future(work)
    exit_task = asyncio.ensure_future(engine.wait())
    try:
        done, _ = await asyncio.wait({work_task, exit_task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        if exit_task in done:
            raise EngineExitedError(phase, exit_task.result(), engine.tail())
        raise LaunchError(phase, f"no answer after {timeout_s:g} s (raise the launcher's timeout for big models)")
    finally:
        for task in (work_task, exit_task):
            task.cancel()
        await asyncio.wait({work_task, exit_task})


async def _poll_health(
    session: aiohttp.ClientSession, url: str, settings: ReadinessSettings, sleep: Callable[[float], Awaitable[None]]
) -> None:
    timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)
    while True:
        try:
            async with session.get(url, timeout=timeout) as response:
                if response.status == 200:
                    return
        except (TimeoutError, aiohttp.ClientError):
            pass  # not listening yet, or busy loading: poll again
        await sleep(settings.poll_interval_s)


async def wait_healthy(
    engine: EngineProcess,
    base_url: str,
    settings: ReadinessSettings,
    session: aiohttp.ClientSession,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Return once ``GET /health`` is 200; raise if the engine exits or the wait times out."""
    await _race_engine_exit(
        engine, "engine_start", _poll_health(session, f"{base_url}/health", settings, sleep), settings.ready_timeout_s
    )


async def _first_token(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise LaunchError("first_ready", f"warm-up completion answered {response.status}: {text[:300]}")
        doc = await response.json(content_type=None)
    if not isinstance(doc, dict) or not doc.get("choices"):
        raise LaunchError("first_ready", f"warm-up completion has no choices: {text[:300]}")
    return doc


async def serve_first_token(
    engine: EngineProcess,
    base_url: str,
    served_name: str,
    settings: ReadinessSettings,
    session: aiohttp.ClientSession,
) -> float:
    """Ask for one token; returns the seconds it took. Raises if the engine cannot serve it."""
    body = {"model": served_name, "prompt": settings.warmup_prompt, "max_tokens": 1, "temperature": 0.0}
    start = time.monotonic()
    try:
        await _race_engine_exit(
            engine,
            "first_ready",
            _first_token(session, f"{base_url}/v1/completions", body),
            settings.first_token_timeout_s,
        )
    except aiohttp.ClientError as e:
        raise LaunchError("first_ready", f"warm-up completion failed: {e}") from e
    return time.monotonic() - start
