"""What the router tells a client held through a cold start (pure: no I/O, no clock).

The router learns a deployment's cold start from the InferenceDeployment it already watches
(docs/router.md, "Held through a cold start"): ``status.measuredColdStartSeconds`` (the launcher's
last measured cold start, copied there by the operator), else ``spec.autoscaling.coldStartSeconds``,
and the weight pull's progress the operator writes into the Progressing condition (``pulling 42%
(58/140 GB), 1.20 GB/s, 1m08s left``). From these and how long the deployment has been waking it
builds the SSE comment a held stream gets, and how long the wake should still take.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.pull_progress import MAX_ETA_S, duration_text

# A comment's text is bounded and single-line: a newline would end the comment and start an event.
MAX_PROGRESS_CHARS = 200
# The pull summary as ``PullReport.summary`` writes it (the operator builds it from numbers only).
_PULL = re.compile(r"pulling \d{1,3}% \([^()]{1,40}\)(?:, [0-9.]+ [KMGT]?B/s)?(?:, (?P<eta>[0-9hms ]{1,12}) left)?")
_DURATION = re.compile(r"^(?:(?P<s>\d+) s|(?P<m>\d+)m(?P<ms>\d{2})s|(?P<h>\d+)h(?P<hm>\d{2})m)$")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


@dataclass(frozen=True)
class ColdStart:
    """A deployment's cold start as the router sees it.

    ``estimate_s``: the whole cold start, from scale-up to a ready replica (measured, else the spec's
    estimate; None: unknown). ``progress``: the pull's summary while one runs (None otherwise).
    ``progress_eta_s``: the pull's own time left, when it says one.
    """

    estimate_s: float | None = None
    progress: str | None = None
    progress_eta_s: float | None = None


NO_COLD_START = ColdStart()  # nothing known: comments say only that the model is waking


def parse_duration_text(text: str) -> float | None:
    """Seconds of ``pull_progress.duration_text``'s ``45 s``, ``3m05s`` or ``2h07m``; None otherwise."""
    found = _DURATION.match(text.strip())
    if found is None:
        return None
    if found["s"] is not None:
        return float(found["s"])
    if found["m"] is not None:
        return float(int(found["m"]) * 60 + int(found["ms"]))
    return float(int(found["h"]) * 3600 + int(found["hm"]) * 60)


def _number(value: Any, bound: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0 <= value <= bound else None


def cold_start_of(obj: Mapping[str, Any], spec_estimate_s: float | None) -> ColdStart:
    """The cold start an InferenceDeployment object states: its measured figure (else the spec's
    estimate) and the pull progress of its Progressing condition. Malformed fields count as absent:
    status is written by the operator, but the router must not fail on an object it watches."""
    status = obj.get("status")
    status = status if isinstance(status, Mapping) else {}
    measured = _number(status.get("measuredColdStartSeconds"), MAX_ETA_S)
    progress, eta = None, None
    conditions = status.get("conditions")
    for cond in conditions if isinstance(conditions, list) else ():
        if not isinstance(cond, Mapping) or cond.get("type") != "Progressing" or cond.get("status") != "True":
            continue
        message = cond.get("message")
        found = _PULL.search(message) if isinstance(message, str) else None
        if found is not None:
            progress = found.group(0)
            eta = parse_duration_text(found["eta"]) if found["eta"] else None
    return ColdStart(measured if measured is not None else spec_estimate_s, progress, eta)


def remaining_s(cold: ColdStart, waking_for_s: float) -> float | None:
    """How long the wake should still take: the estimate less the time it has run, and never less than
    a running pull's own time left (a pull is a lower bound: the engine still starts after it). None:
    nothing to go by."""
    left = None if cold.estimate_s is None else max(0.0, cold.estimate_s - waking_for_s)
    if cold.progress_eta_s is not None:
        left = cold.progress_eta_s if left is None else max(left, cold.progress_eta_s)
    return left


def retry_after_s(remaining: float) -> int:
    """Whole seconds for Retry-After: rounded up, at least 1."""
    return max(1, math.ceil(remaining))


def one_line(text: str) -> str:
    """Printable ASCII on one line, at most MAX_PROGRESS_CHARS: safe inside an SSE comment."""
    return _UNPRINTABLE.sub(" ", text)[:MAX_PROGRESS_CHARS]


def comment(model: str, cold: ColdStart, held_s: float, waking_for_s: float) -> bytes:
    """One SSE comment: ``: cold start: pulling 42% (58/140 GB), 1.20 GB/s, 1m08s left; held 12 s``.

    A comment (a line starting with a colon, then a blank line) is legal SSE that every client ignores;
    it is what keeps a proxy's idle timer from firing while nothing else moves.
    """
    if cold.progress is not None:
        what = cold.progress
    elif cold.estimate_s is not None and waking_for_s >= cold.estimate_s:
        what = f"waking {model}, longer than its {duration_text(cold.estimate_s)} estimate"
    else:
        left = remaining_s(cold, waking_for_s)
        what = f"waking {model}" + (f", about {duration_text(left)} left" if left is not None else "")
    held = duration_text(math.floor(held_s))  # whole seconds held so far (time left rounds up instead)
    return b": cold start: " + one_line(f"{what}; held {held}").encode() + b"\n\n"


def waiting_comment(held_s: float) -> bytes:
    """A comment while the leased replica prepares the first token."""
    return b": cold start: replica ready, waiting for its first token; held %d s\n\n" % math.floor(held_s)


def ready_comment(held_s: float) -> bytes:
    """The last comment, before the first token: how long the request was held in all."""
    return b": cold start: replica ready after %.1f s held\n\n" % held_s


def starting_message(model: str, remaining: float, bound_s: float) -> str:
    """Why a request that cannot wait for the wake is answered 503 at once."""
    return (
        f"model {model!r} is starting from zero replicas (cold start): it should be ready in about "
        f"{duration_text(remaining)}, longer than this request may be held (routing.maxQueueWaitSeconds "
        f"{bound_s:g}); retry after the Retry-After seconds, or stream the request to be held with progress"
    )
