"""Phase 3: the steady state after convergence: API requests per minute by component and verb
(audit log), CPU seconds per minute and peak RSS of each component; then the baseline in the same
run, the operator reading children and pods by GET (``--no-cache-children``)."""

from __future__ import annotations

import asyncio
from typing import Any

from .audit import WRITE_VERBS, audit_entries, by_code, by_component_and_verb, succeeded
from .cluster import Component, ScaleRun
from .objects import loadavg, now_iso


async def steady(s: ScaleRun) -> dict[str, Any]:
    procs = s.procs
    await asyncio.sleep(15)  # the last status writes and Events of convergence settle
    cpu0 = {k: c.cpu_s() for k, c in procs.items()}
    since = now_iso()
    await asyncio.sleep(s.window_s)
    until = now_iso()
    cpu1 = {k: c.cpu_s() for k, c in procs.items()}
    minutes = s.window_s / 60
    entries = audit_entries(s.cluster.audit, since, until)
    per = by_component_and_verb(entries, minutes)
    # Writes that changed something: a refused or timed-out one (429, 409, 504) is load, not a write.
    done = by_component_and_verb(entries, minutes, succeeded)
    beyond = sum(v for c in per.values() for verb, v in c.items() if verb != "watch")
    writes = sum(v for c in done.values() for verb, v in c.items() if verb in WRITE_VERBS)
    return {
        "window_s": s.window_s,
        "per_minute": per,
        "by_code_per_minute": by_code(entries, minutes),
        "beyond_watches_per_minute": round(beyond, 1),
        "writes_per_minute": round(writes, 1),
        "writes_per_minute_by_component": {
            c: sum(x for verb, x in vs.items() if verb in WRITE_VERBS) for c, vs in done.items()
        },
        "cpu_s_per_minute": {k: round((cpu1[k] - cpu0[k]) / minutes, 2) for k in procs},
        "peak_rss_mb": {k: c.peak_rss_mb() for k, c in procs.items()},
        "rss_mb": {k: c.rss_mb() for k, c in procs.items()},
        "loadavg": loadavg(),
    }


async def steady_reads_by_get(s: ScaleRun) -> dict[str, Any]:
    """The same window with the operator reading by GET; the cached operator is started again after.
    Its window is ``s.baseline_window_s`` (0: skipped; at 1,000 deployments the GETs alone load the
    2 cores for as long as it lasts)."""
    if s.baseline_window_s <= 0:
        return {"skipped": True}
    folder, kc = s.cluster.folder, s.kc["operator"]
    s.procs["operator"].stop()
    uncached = Component("operator-by-get", [*s.procs["operator"].argv, "--no-cache-children"], kc, folder).start()
    await asyncio.sleep(45)  # resumed, and past its first resync of every deployment
    since = now_iso()
    await asyncio.sleep(s.baseline_window_s)
    per = by_component_and_verb(audit_entries(s.cluster.audit, since, now_iso()), s.baseline_window_s / 60)
    result = {
        "window_s": s.baseline_window_s,
        "operator_per_minute": per.get("operator", {}),
        "operator_beyond_watches_per_minute": round(
            sum(v for verb, v in per.get("operator", {}).items() if verb != "watch"), 1
        ),
        "operator_peak_rss_mb": uncached.peak_rss_mb(),
    }
    uncached.stop()
    s.procs["operator"] = Component("operator", s.procs["operator"].argv, kc, folder).start()
    await asyncio.sleep(20)  # resumed: its caches listed, every deployment checked
    return result
