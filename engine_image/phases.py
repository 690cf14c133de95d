"""Cold-start phase timing: a small recorder with an injected clock, and its log line.

Phases run one after another (pull, artifacts, engine_start, first_ready); the total is their sum,
which is launch-to-first-token. Each finished phase is logged as one JSON line so a log pipeline
can chart cold starts without parsing prose.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .errors import TIMED_PHASES, Phase

Clock = Callable[[], float]


@dataclass(frozen=True)
class PhaseRecord:
    """One finished phase: how long it took and what it found (cache hit or miss, bytes...)."""

    phase: Phase
    seconds: float
    detail: Mapping[str, Any] = field(default_factory=dict)

    def log_line(self) -> str:
        return json.dumps(
            {"event": "coldstart_phase", "phase": self.phase, "seconds": round(self.seconds, 4), **self.detail},
            sort_keys=False,
            default=str,
        )


class PhaseRecorder:
    """Times phases with ``clock`` (monotonic seconds) and tells ``on_record`` about each one."""

    def __init__(self, clock: Clock = time.monotonic, on_record: Callable[[PhaseRecord], None] | None = None) -> None:
        self._clock = clock
        self._on_record = on_record
        self._records: dict[Phase, PhaseRecord] = {}
        self._current: Phase | None = None

    @contextmanager
    def phase(self, name: Phase) -> Iterator[dict[str, Any]]:
        """Time the body; the yielded dict becomes the record's detail. Failed phases are not recorded."""
        if name in self._records:
            raise ValueError(f"phase {name} was already recorded")
        detail: dict[str, Any] = {}
        start = self._clock()
        self._current = name
        try:
            yield detail
        finally:
            self._current = None
        record = PhaseRecord(name, max(0.0, self._clock() - start), dict(detail))
        self._records[name] = record
        if self._on_record is not None:
            self._on_record(record)

    @property
    def current(self) -> Phase | None:
        """The phase running now (None between phases and after the last one)."""
        return self._current

    @property
    def records(self) -> Mapping[Phase, PhaseRecord]:
        return dict(self._records)

    @property
    def complete(self) -> bool:
        return all(p in self._records for p in TIMED_PHASES)

    def total_seconds(self) -> float:
        return sum(r.seconds for r in self._records.values())

    def report(self) -> dict[str, Any]:
        """The ``/coldstart`` document the operator reads for ``status.measuredColdStartSeconds``
        (docs/contracts.md): seconds per phase, and what each phase found beside them."""
        return {
            "complete": self.complete,
            "totalSeconds": round(self.total_seconds(), 4) if self.complete else None,
            "phases": {p: round(r.seconds, 4) for p, r in self._records.items()},
            "phaseDetails": {p: dict(r.detail) for p, r in self._records.items()},
        }
