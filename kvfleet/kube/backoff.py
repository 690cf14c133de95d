"""Jittered exponential back-off, and how long to wait when the API server asks for it (pure)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

MAX_RETRY_AFTER_S = 60.0
"""A Retry-After above this is capped: a bad header must not park a component for hours."""


@dataclass(frozen=True)
class Backoff:
    """``base_s * 2**attempt`` capped at ``max_s``, then "equal jitter": a wait drawn from
    [cap/2, cap], so a fleet of routers that lost the API server together comes back spread out
    (never all at once) and never sooner than half the nominal wait."""

    base_s: float = 0.5
    max_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s <= 3600:
            raise ValueError(f"need 0 < base_s <= max_s <= 3600, got {self.base_s}, {self.max_s}")

    def cap_s(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * 2 ** min(max(attempt, 0), 32))

    def wait_s(
        self, attempt: int, retry_after_s: float | None = None, rand: Callable[[], float] = random.random
    ) -> float:
        """The wait before retry ``attempt`` (0-based). A server's Retry-After (429, 503) is a floor:
        we wait at least that long (capped at ``MAX_RETRY_AFTER_S``), plus up to 20% jitter."""
        cap = self.cap_s(attempt)
        jittered = cap / 2 + rand() * cap / 2
        if retry_after_s is not None and retry_after_s > 0:
            floor = min(retry_after_s, MAX_RETRY_AFTER_S)
            return max(jittered, floor * (1 + 0.2 * rand()))
        return jittered


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (the API server sends delta-seconds); None if absent or odd."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
