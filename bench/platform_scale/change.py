"""Phase 4: a spec change to every deployment at once: the time until every one has rolled (its
engine Deployment's every replica current and ready) and says so, and the peak request rate."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .audit import audit_entries, by_code, component_of, peak_per_second
from .cluster import ScaleRun, wait_each
from .objects import INFD, infd_rolled, loadavg, now_iso


async def change_all(s: ScaleRun) -> dict[str, Any]:
    limit = asyncio.Semaphore(32)

    async def change(key: tuple[str, str]) -> None:
        async with limit:
            patch = {"spec": {"engine": {"maxModelLen": 4096}}}
            await s.admin.merge_patch(INFD.item(*key), patch, field_manager="bench")

    procs = s.procs
    since = now_iso()
    t2 = time.monotonic()
    cpu0 = {k: c.cpu_s() for k, c in procs.items()}
    await asyncio.gather(*(change(k) for k in sorted(s.valid)))
    patched_s = time.monotonic() - t2
    rolled = await wait_each(s.admin, INFD, s.valid, infd_rolled, s.phase_timeout_s)
    change_s = time.monotonic() - t2
    entries = audit_entries(s.cluster.audit, since, now_iso())
    return {
        "rolled": len(rolled),
        "not_rolled": len(s.valid) - len(rolled),
        "patches_sent_s": round(patched_s, 1),
        "total_s": round(max(rolled.values(), default=t2) - t2, 1),
        "peak_requests_per_s": peak_per_second(entries),
        "requests": len([e for e in entries if component_of(e, {})]),
        "requests_by_code": by_code(entries),
        "cpu_s_per_minute": {k: round((c.cpu_s() - cpu0[k]) / (change_s / 60), 1) for k, c in procs.items()},
        "loadavg": loadavg(),
    }
