"""Retry a start-up request while its failure can heal (``KubeError.retryable``: 429, 5xx, no
connection), on a jittered back-off that honours the server's Retry-After; raise the last error."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvfleet.kube.backoff import Backoff
from kvfleet.kube.errors import KubeError

T = TypeVar("T")


async def retry_while_healing(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    backoff: Backoff,
    what: str,
    log: logging.Logger,
    level: int = logging.WARNING,
    rand: Callable[[], float] = random.random,
) -> T:
    """``call()`` up to ``attempts`` times; a failure that cannot heal (403, 404, ...) is raised at once.
    Each retry is logged at ``level`` as ``what (attempt i/n): error; again in Xs``."""
    if not 1 <= attempts <= 100:
        raise ValueError(f"attempts must be in [1, 100], got {attempts}")
    for attempt in range(attempts):
        try:
            return await call()
        except KubeError as e:
            if attempt == attempts - 1 or not e.retryable:
                raise
            wait_s = backoff.wait_s(attempt, e.retry_after_s, rand)
            log.log(level, "%s (attempt %d/%d): %s; again in %.1fs", what, attempt + 1, attempts, e, wait_s)
            await asyncio.sleep(wait_s)
    raise AssertionError("unreachable: the last attempt returns or raises")
