"""Phase 6, bad input at scale: a namespace deleted with DOOMED deployments in it (time until it and
every child is gone), and 500 replicas asked of a GPU product the cluster has 300 of (what status
says). The invalid specs among the N are measured with the apply (apply.py)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from .cluster import ScaleRun, create_all, wait_each
from .objects import DOOMED, INFD, NAMESPACES, SMALL_POOL, SMALL_PRODUCT, condition, infd, infd_ready, namespace_of


async def namespace_deleted(s: ScaleRun) -> dict[str, Any]:
    doomed = [infd(f"d{i:03d}", "doomed", replicas=1) for i in range(DOOMED)]
    created = await create_all(s.admin, INFD, doomed)
    await wait_each(s.admin, INFD, set(created), infd_ready, s.phase_timeout_s)
    t4 = time.monotonic()
    await s.admin.delete_object(NAMESPACES, None, "doomed")
    gone = None
    while time.monotonic() - t4 < s.phase_timeout_s:
        if await s.admin.get_object(NAMESPACES, None, "doomed") is None:
            gone = time.monotonic() - t4
            break
        await asyncio.sleep(1)
    return {"deployments": DOOMED, "namespace_gone_after_s": round(gone, 1) if gone else None}


async def oversized(s: ScaleRun) -> dict[str, Any]:
    ns = namespace_of(0, s.n)
    t5 = time.monotonic()
    await create_all(s.admin, INFD, [infd("huge", ns, replicas=500, product=SMALL_PRODUCT)])
    said: dict[str, Any] = {}
    while time.monotonic() - t5 < s.phase_timeout_s:
        o = await s.admin.get_object(INFD, ns, "huge") or {}
        status = o.get("status") or {}
        said = {
            "ready_replicas": status.get("readyReplicas"),
            "ready": condition(o, "Ready"),
            "progressing": condition(o, "Progressing"),
            "degraded": condition(o, "Degraded"),
            "after_s": round(time.monotonic() - t5, 1),
        }
        # Done when all that fits is Ready and status names the pods that do not fit.
        if status.get("readyReplicas") == SMALL_POOL[0] * SMALL_POOL[1] and "Unschedulable" in json.dumps(status):
            break
        await asyncio.sleep(2)
    return said
