"""Phase 2: N InferenceDeployments (and N/10 invalid ones) applied at once, each one's apply-to-Ready
time and each invalid one's time to Degraded and its Event; then a new router's time until it lists
every model's every endpoint."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .audit import audit_entries, by_request
from .cluster import ScaleRun, create_all, list_all, router_port, router_replicas, wait_each
from .objects import (
    BAD_REASONS,
    DEPLOYMENTS,
    EVENTS,
    INFD,
    REPLICAS,
    condition,
    infd,
    infd_ready,
    namespace_of,
    now_iso,
    summary,
)


async def apply_all(s: ScaleRun) -> dict[str, Any]:
    n = s.n
    bad = max(1, n // 10)
    # The invalid ones among the valid (one after every tenth), as a platform's users would apply them.
    docs = []
    for i in range(n):
        docs.append(infd(f"m{i:04d}", namespace_of(i, n)))
        if i % 10 == 9 and i // 10 < bad:
            docs.append(infd(f"bad{i // 10:04d}", namespace_of(i // 10, n), invalid=True))
    docs += [infd(f"bad{j:04d}", namespace_of(j, n), invalid=True) for j in range((n // 10), bad)]
    print(f"[{n}] apply {n} InferenceDeployments (+{bad} invalid)", flush=True)
    valid = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["metadata"]["name"].startswith("m")}
    # When the operator created each engine Deployment: its share of apply-to-Ready, the rest the
    # controllers' and kwok's (and the status write's). The watch lists before the creates go out.
    engines = {(ns, f"{name}-engine"): (ns, name) for ns, name in valid}
    engine_seen = asyncio.ensure_future(wait_each(s.admin, DEPLOYMENTS, set(engines), bool, s.phase_timeout_s))
    await asyncio.sleep(1)
    cpu = s.cpu_meter()
    cpu.start()
    since, t0 = now_iso(), time.monotonic()
    created = await create_all(s.admin, INFD, docs)
    s.valid = valid & set(created)
    invalid = set(created) - s.valid
    ready, degraded = await asyncio.gather(
        wait_each(s.admin, INFD, s.valid, infd_ready, s.phase_timeout_s),
        wait_each(
            s.admin,
            INFD,
            invalid,
            lambda o: condition(o, "Degraded").get("reason") in BAD_REASONS,
            s.phase_timeout_s,
        ),
    )
    spent = cpu.spent()
    applied_at = await engine_seen
    shares: dict[str, list[float]] = {"engine_created": [], "engine_to_ready": []}
    for engine, owner in engines.items():
        if engine in applied_at and owner in ready and owner in created:
            shares["engine_created"].append(applied_at[engine] - created[owner])
            shares["engine_to_ready"].append(ready[owner] - applied_at[engine])
    # What the operator asked of the API server while they came up (the audit log), per deployment.
    operator = by_request(audit_entries(s.cluster.audit, since, now_iso()), "operator")
    events = await list_all(s.admin, EVENTS)
    evented = {
        (e["involvedObject"].get("namespace"), e["involvedObject"].get("name"))
        for e in events
        if e.get("reason") in BAD_REASONS
    }
    return {
        "apply": {
            **summary([ready[k] - created[k] for k in ready]),
            "total_s": round(max(ready.values(), default=t0) - t0, 1),
            "not_ready": len(s.valid) - len(ready),
            "operator_requests": operator,
            "operator_requests_per_deployment": round(sum(operator.values()) / max(1, len(created)), 1),
            "per_deployment": {k: summary(v) for k, v in shares.items()},
            "engines_created_s": round(max(applied_at.values(), default=t0) - t0, 1),
            "cpu_s": spent,
        },
        "invalid": {
            "applied": len(invalid),
            "degraded": len(degraded),
            "with_event": len(invalid & evented),
            **{f"to_degraded_{k}": v for k, v in summary([degraded[k] - created[k] for k in degraded]).items()},
        },
    }


async def new_router(s: ScaleRun) -> dict[str, Any]:
    """A router started after convergence: time until it lists every model's every endpoint."""
    t1 = time.monotonic()
    s.procs["router-2"].start()
    port = router_port(s.procs["router-2"])
    want = s.n * REPLICAS
    while router_replicas(port) < want and time.monotonic() - t1 < s.phase_timeout_s:  # noqa: ASYNC110
        await asyncio.sleep(0.5)
    return {"new_router_ready_s": round(time.monotonic() - t1, 1), "new_router_listed": router_replicas(port)}
