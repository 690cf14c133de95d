"""The wake signal: the router tells the autoscaler a deployment has requests waiting and no replica.

Two implementations of one interface: ``HttpWakeSignal`` (``POST <autoscaler>/v1/wake``, see
docs/contracts.md) and ``InProcessWakeSignal`` (local mode calls the autoscaler directly).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import aiohttp

from kvfleet.wake_token import WakeToken


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
