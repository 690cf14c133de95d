"""The wake signal: the router tells the autoscaler a deployment has requests waiting and no replica.

Two implementations of one interface: ``HttpWakeSignal`` (``POST <autoscaler>/v1/wake``, see
docs/contracts.md) and ``InProcessWakeSignal`` (local mode calls the autoscaler directly).
``WakeRepeater`` sends it again while requests keep waiting.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import aiohttp

from kvfleet.wake_token import WakeToken

log = logging.getLogger(__name__)


class WakeError(Exception):
    """The autoscaler could not be told (unreachable, or answered other than 2xx)."""


class WakeSignal(Protocol):
    async def wake(self, namespace: str, name: str) -> None:
        """Ask for at least one replica of the deployment; raises ``WakeError`` when that fails."""


class NoWakeSignal:
    """No autoscaler to tell (fixed replicas): held requests wait for a replica to appear by itself."""

    async def wake(self, namespace: str, name: str) -> None:
        return None


class InProcessWakeSignal:
    """Calls ``callback(namespace, name)``, which may be sync or async."""

    def __init__(self, callback: Callable[[str, str], Awaitable[None] | None]) -> None:
        self._callback = callback

    async def wake(self, namespace: str, name: str) -> None:
        try:
            result = self._callback(namespace, name)
            if inspect.isawaitable(result):
                await result
        except WakeError:
            raise
        except Exception as e:  # the callback's own failure, translated at this boundary
            raise WakeError(f"wake callback failed: {e!r}") from e


class HttpWakeSignal:
    """``POST {base_url}/v1/wake`` with ``{"namespace", "name"}``; any 2xx (202 by contract) is success."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        session: aiohttp.ClientSession | None = None,
        token_file: Path | None = None,
    ) -> None:
        self._url = base_url.rstrip("/") + "/v1/wake"
        self._token_file = token_file  # read per wake: a rotated Secret takes effect at once
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owns_session = session is None

    async def wake(self, namespace: str, name: str) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            headers = {}
            if self._token_file is not None:
                headers["Authorization"] = f"Bearer {WakeToken(self._token_file).read().decode()}"
            async with self._session.post(
                self._url, json={"namespace": namespace, "name": name}, timeout=self._timeout, headers=headers
            ) as resp:
                if resp.status // 100 != 2:
                    text = (await resp.text())[:200]
                    raise WakeError(f"autoscaler answered {resp.status}: {text}")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise WakeError(f"autoscaler unreachable at {self._url}: {e!r}") from e
        except (OSError, ValueError) as e:  # ValueError: empty, oversized or not text
            raise WakeError(f"wake token unreadable: {e}") from e

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None


class WakeRepeater:
    """Sends a deployment's wake signal now, then every ``interval_s`` while ``needed(key)`` still names
    it (requests held and no replica taking them): one task per deployment, gone when it is not needed.

    A failed or slow signal (each bounded by ``timeout_s``) is logged and tried again next interval; it
    never fails the held requests, which wait out their own queue deadline.
    """

    def __init__(self, signal: WakeSignal, *, interval_s: float, timeout_s: float) -> None:
        self._signal = signal
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._single: dict[str, asyncio.Task[None]] = {}  # one-shot signals, at most one in flight per key

    def once(self, key: str, namespace: str, name: str) -> None:
        """Send the signal once, in the background, unless one for ``key`` is already on its way."""
        task = self._single.get(key)
        if task is not None and not task.done():
            return
        self._single[key] = asyncio.get_running_loop().create_task(self._send(namespace, name))

    async def _send(self, namespace: str, name: str) -> None:
        try:
            await asyncio.wait_for(self._signal.wake(namespace, name), self._timeout_s)
        except (WakeError, TimeoutError) as e:
            log.warning("wake signal for %s/%s failed: %s", namespace, name, e)

    def start(self, key: str, needed: Callable[[str], tuple[str, str] | None]) -> None:
        """Start repeating for ``key`` unless already; ``needed`` gives its (namespace, name) or None to stop."""
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return
        self._tasks[key] = asyncio.get_running_loop().create_task(self._repeat(key, needed))

    async def _repeat(self, key: str, needed: Callable[[str], tuple[str, str] | None]) -> None:
        await asyncio.sleep(0)  # let the request that started this enter the queue
        while (target := needed(key)) is not None:
            await self._send(*target)
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._single.values()]
        self._tasks.clear()
        self._single.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
