"""Phase 4: a spec change to every deployment at once: the time until every one has rolled (its
engine Deployment's every replica current and ready) and says so, and the peak request rate."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .audit import audit_entries, by_code, component_of, peak_per_second
from .cluster import ScaleRun, newer_than_now, wait_each
from .objects import DEPLOYMENTS, INFD, deployment_ready, infd_rolled, loadavg, now_iso, summary


async def change_all(s: ScaleRun) -> dict[str, Any]:
    limit = asyncio.Semaphore(32)

    async def change(key: tuple[str, str]) -> None:
        async with limit:
            patch = {"spec": {"engine": {"maxModelLen": 4096}}}
            await s.admin.merge_patch(INFD.item(*key), patch, field_manager="bench")

    procs = s.procs
    # The engine Deployments' generations before: one past it is the operator's new template.
    engines = {(ns, f"{name}-engine"): (ns, name) for ns, name in s.valid}
    templated = await newer_than_now(s.admin, DEPLOYMENTS)

    # Beside the InferenceDeployments, their engine Deployments: when the operator applied the new
    # template, and when the controllers had rolled it. The first is the operator's share, the
    # second the controllers' (what the floor measures); the rest, until status says rolled, is the
    # operator's again. The watches start before the patches go out.
    timeout_s = s.change_bound_s
    waits = asyncio.gather(
        wait_each(s.admin, INFD, s.valid, infd_rolled, timeout_s),
        wait_each(s.admin, DEPLOYMENTS, set(engines), templated, timeout_s),
        wait_each(s.admin, DEPLOYMENTS, set(engines), lambda d: templated(d) and deployment_ready(d), timeout_s),
    )
    await asyncio.sleep(2)  # the watches have listed (at 1,000 objects, a second or so)
    since = now_iso()
    t2 = time.monotonic()
    cpu0 = {k: c.cpu_s() for k, c in procs.items()}
    meter = s.cpu_meter()
    meter.start()
    await asyncio.gather(*(change(k) for k in sorted(s.valid)))
    patched_s = time.monotonic() - t2
    rolled, applied, engine_rolled = await waits
    change_s = time.monotonic() - t2
    spent = meter.spent()
    shares: dict[str, list[float]] = {"template_applied": [], "controllers_rolled": [], "status_rolled": []}
    for engine, owner in engines.items():
        if engine in applied and engine in engine_rolled and owner in rolled:
            shares["template_applied"].append(applied[engine] - t2)
            shares["controllers_rolled"].append(engine_rolled[engine] - applied[engine])
            shares["status_rolled"].append(rolled[owner] - engine_rolled[engine])
    entries = audit_entries(s.cluster.audit, since, now_iso())
    return {
        "bound_s": round(timeout_s, 1),
        "rolled": len(rolled),
        "not_rolled": len(s.valid) - len(rolled),
        "patches_sent_s": round(patched_s, 1),
        "total_s": round(max(rolled.values(), default=t2) - t2, 1),
        "engine_deployments_rolled_s": round(max(engine_rolled.values(), default=t2) - t2, 1),
        "templates_applied_s": round(max(applied.values(), default=t2) - t2, 1),
        "per_deployment": {k: summary(v) for k, v in shares.items()},
        "peak_requests_per_s": peak_per_second(entries),
        "requests": len([e for e in entries if component_of(e, {})]),
        "requests_by_code": by_code(entries),
        "cpu_s_per_minute": {k: round((c.cpu_s() - cpu0[k]) / (change_s / 60), 1) for k, c in procs.items()},
        "cpu_s": spent,
        "loadavg": loadavg(),
    }
