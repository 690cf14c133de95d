"""Phase 5: restarts. The operator killed (-9) while one deployment changes, and started again:
the time until it has acted on that change and the requests it made catching up; and a watch of
every InferenceDeployment resumed from an expired resourceVersion (410 Gone): the relist."""

from __future__ import annotations

import asyncio
import collections
import signal
import time
from typing import Any

from kvfleet.free_port import pick_free_port
from kvfleet.kube import KubeClient
from kvfleet.kube.watch import ResourceWatch

from .audit import WRITE_VERBS, audit_entries, by_code, component_of, succeeded
from .cluster import ScaleRun, components
from .objects import DEPLOYMENTS, INFD, REPLICAS, now_iso


async def operator_restart(s: ScaleRun) -> dict[str, Any]:
    s.procs["operator"].stop(signal.SIGKILL)
    key = sorted(s.valid)[0]
    await s.admin.merge_patch(INFD.item(*key), {"spec": {"replicas": REPLICAS + 1}}, field_manager="bench")
    op = components(s.kc, s.cluster.folder, pick_free_port())["operator"]
    op.name = "operator-restarted"
    s.procs["operator"] = op.start()
    t3 = op.started_at
    acted = None
    while time.monotonic() - t3 < s.phase_timeout_s:
        d = await s.admin.get_object(DEPLOYMENTS, key[0], f"{key[1]}-engine")
        if d and d["spec"]["replicas"] == REPLICAS + 1:
            acted = time.monotonic() - t3
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(30)
    mine = [e for e in audit_entries(s.cluster.audit, op.started_iso, now_iso()) if component_of(e, {}) == "operator"]
    return {
        "acted_on_change_after_s": round(acted, 1) if acted is not None else None,
        "first_request_after_start": min((e["requestReceivedTimestamp"] for e in mine), default=None),
        "requests_first_30s_after_acting": dict(collections.Counter(e["verb"] for e in mine)),
        "writes": sum(1 for e in mine if e["verb"] in WRITE_VERBS and succeeded(e)),
        "requests_by_code": by_code(mine),
    }


async def watch_410(api: KubeClient) -> dict[str, Any]:
    """A watch of every InferenceDeployment resumed from a compacted resourceVersion: 410, relist."""
    watch = ResourceWatch(api, INFD.collection(None), lambda key, obj: None)
    await watch.sync()
    watch.version = "1"  # long compacted: the server answers 410 Gone
    lists_before = watch.stats.lists
    t0 = time.monotonic()
    task = asyncio.create_task(watch.run())
    try:
        while not (watch.stats.gone and watch.synced):
            await asyncio.sleep(0.05)
            if time.monotonic() - t0 > 120:
                break
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return {
        "objects": len(watch.store),
        "gone_seen": watch.stats.gone,
        "relist_pages": watch.stats.lists - lists_before,
        "resumed_after_s": round(time.monotonic() - t0, 2),
        "note": "includes the jittered back-off before the relist (kvfleet.kube.backoff)",
    }
