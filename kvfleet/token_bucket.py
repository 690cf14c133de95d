"""A token bucket: ``rate`` takes a second, in bursts of up to ``burst``.

The router bounds the KV-event batches it applies per replica with one (``router/kv_subscriber.py``)
and the reference engine the replays it serves (``engine/kv_events_replay.py``). Pure and shared, so
the engine stays a leaf by importing it (tests/engine/test_leaf.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` per second, bursts up to ``burst`` (default: ``rate``); starts full."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = rate if burst is None else burst
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
