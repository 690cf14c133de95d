"""Phase 1, the floor: N plain Deployments with the same pods, created at once, then a template
change to all of them (what the kwok nodes and the Kubernetes controllers themselves allow).

The pods are the engine pods kvfleet runs (``objects.plain_deployment``): the floor is then what
the cluster costs for those pods, and the gap to kvfleet is kvfleet's own (its operator, children,
status and watches). ``pods="minimal"`` runs the bare-pod floor of earlier runs beside it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvfleet.kube import KubeClient

from .cluster import CpuMeter, create_all, list_all, wait_each
from .objects import DEPLOYMENTS, PODS, deployment_ready, namespace_of, plain_deployment, summary


async def floor(api: KubeClient, n: int, timeout_s: float, cpu: CpuMeter, pods: str = "engine") -> dict[str, Any]:
    prefix = "plain" if pods == "engine" else "bare"  # a name of its own: the two floors may run one after the other
    docs = [plain_deployment(f"{prefix}-{i:04d}", namespace_of(i, n), pods) for i in range(n)]
    cpu.start()
    t0 = time.monotonic()
    created = await create_all(api, DEPLOYMENTS, docs)
    ready = await wait_each(api, DEPLOYMENTS, set(created), deployment_ready, timeout_s, "")
    out: dict[str, Any] = {
        "pods": pods,
        "create_to_ready": summary([ready[k] - created[k] for k in ready]),
        "total_s": round(max(ready.values(), default=t0) - t0, 1),
        "timed_out": len(ready) < n,
        "cpu_s": cpu.spent(),
    }
    # A template change to all at once (new pods for every one), then the time until all are rolled.
    cpu.start()
    t1 = time.monotonic()
    limit = asyncio.Semaphore(32)

    async def bump(doc: dict) -> None:
        async with limit:
            m = doc["metadata"]
            patch = {"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}}
            await api.merge_patch(DEPLOYMENTS.item(m["namespace"], m["name"]), patch, field_manager="bench")

    await asyncio.gather(*(bump(d) for d in docs))
    rolled = await wait_each(api, DEPLOYMENTS, set(created), deployment_ready, timeout_s)
    out["change_all_s"] = round(max(rolled.values(), default=t1) - t1, 1)
    out["change_cpu_s"] = cpu.spent()
    out["change_timed_out"] = len(rolled) < n
    for d in docs:
        m = d["metadata"]
        await api.delete_object(DEPLOYMENTS, m["namespace"], m["name"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and await list_all(api, PODS, "app"):  # noqa: ASYNC110 (polls the server)
        await asyncio.sleep(2)
    return out
