"""Phase 1, the floor: N plain Deployments with the same pods, created at once, then a template
change to all of them (what the kwok nodes and the Kubernetes controllers themselves allow).

The pods are the engine pods kvfleet runs (``objects.plain_deployment``): the floor is then what
the cluster costs for those pods, and the gap to kvfleet is kvfleet's own (its operator, children,
status and watches). ``pods="minimal"`` runs the bare-pod floor of earlier runs beside it;
``children_floor`` the objects kvfleet creates without its processes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvfleet.contracts import DEPLOYMENT_LABEL
from kvfleet.kube import KubeClient, Ref
from kvfleet.operator.render import CHILD_KINDS, Owner, apply_waves, kind_of, render_children
from kvfleet.operator.settings import OperatorSettings

from .cluster import CpuMeter, create_all, newer_than_now, until_no_pods, wait_each
from .objects import (
    DEPLOYMENTS,
    REPLICAS,
    deployment_ready,
    engine_spec,
    namespace_of,
    plain_deployment,
    summary,
)

CHILD_REFS = {k.kind: Ref(k.api_version, k.plural) for k in CHILD_KINDS}


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
    await until_no_pods(api, "app", timeout_s)
    return out


async def children_floor(api: KubeClient, n: int, timeout_s: float, cpu: CpuMeter) -> dict[str, Any]:
    """The objects without the processes: for N deployments, the children the operator renders (two
    ConfigMaps, Service, Deployment, PodDisruptionBudget, ServiceMonitor) applied by this script in
    the operator's two waves, with no operator, router or autoscaler running; then the change the
    operator makes for a new spec (the spec ConfigMap and the Deployment's template). Against the
    floor it is what kvfleet's objects cost the cluster; against kvfleet, what its processes
    (reconciles, status, Events, watches) add."""
    settings = OperatorSettings()
    kids: dict[tuple[str, str], list[dict]] = {}  # engine Deployment (namespace, name) -> every child
    for i in range(n):
        name, ns = f"kids-{i:04d}", namespace_of(i, n)
        children = render_children(Owner(name, ns), engine_spec(name, ns), REPLICAS, settings, service_monitor=True)
        engine = next(c for c in children if c["kind"] == "Deployment")["metadata"]
        kids[(engine["namespace"], engine["name"])] = children
    engines = set(kids)
    limit = asyncio.Semaphore(32)  # as the floor's creates
    begun: dict[tuple[str, str], float] = {}

    async def apply(key: tuple[str, str]) -> None:
        async with limit:
            begun[key] = time.monotonic()
            for wave in apply_waves(kids[key], kind_of):
                await asyncio.gather(*(api.apply(CHILD_REFS[c["kind"]], c, field_manager="bench") for c in wave))

    waits = asyncio.create_task(wait_each(api, DEPLOYMENTS, engines, deployment_ready, timeout_s))
    await asyncio.sleep(2)  # the watch has listed
    cpu.start()
    t0 = time.monotonic()
    await asyncio.gather(*(apply(key) for key in kids))
    ready = await waits
    out: dict[str, Any] = {
        "create_to_ready": summary([ready[k] - begun[k] for k in ready]),
        "total_s": round(max(ready.values(), default=t0) - t0, 1),
        "timed_out": len(ready) < n,
        "cpu_s": cpu.spent(),
    }
    templated = await newer_than_now(api, DEPLOYMENTS)

    async def change(children: list[dict]) -> None:
        async with limit:
            spec_map, deployment = children[0], next(c for c in children if c["kind"] == "Deployment")
            spec_map["data"] = {**spec_map["data"], "changed": "2"}
            deployment["spec"]["template"]["metadata"]["annotations"]["rev"] = "2"
            await asyncio.gather(
                *(api.apply(CHILD_REFS[c["kind"]], c, field_manager="bench") for c in (spec_map, deployment))
            )

    waits = asyncio.create_task(
        wait_each(api, DEPLOYMENTS, engines, lambda d: templated(d) and deployment_ready(d), timeout_s)
    )
    await asyncio.sleep(2)
    cpu.start()
    t1 = time.monotonic()
    await asyncio.gather(*(change(c) for c in kids.values()))
    done = await waits
    out["change_all_s"] = round(max(done.values(), default=t1) - t1, 1)
    out["change_cpu_s"] = cpu.spent()
    out["change_timed_out"] = len(done) < n
    for children in kids.values():
        for c in children:
            await api.delete_object(CHILD_REFS[c["kind"]], c["metadata"]["namespace"], c["metadata"]["name"])
    await until_no_pods(api, DEPLOYMENT_LABEL, timeout_s)
    return out
