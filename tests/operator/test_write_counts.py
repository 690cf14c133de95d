"""The requests the operator sends to create a few InferenceDeployments, counted by kind and verb.

Each write costs the API server at scale (docs/benchmarks/scale.md): creating a deployment needs
each child applied exactly once (two ConfigMaps: the launcher's spec and the model pin), and a
rollout nudge or a resync sends only what changed, and reads the object again only before its
first writes.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from kvfleet_testkit.kube_emulator import (
    DEPLOYMENTS,
    INFD,
    Cluster,
    RunningOperator,
    eventually,
    operator_settings,
    start_operator,
    stop_operator,
)

NS = "default"
COUNT = 3
CHILD_WRITES = ("PATCH configmaps", "PATCH deployments", "PATCH services", "PATCH poddisruptionbudgets")
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def infd(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            # An s3:// model: its pin ConfigMap holds the model source (file:// models pin nothing).
            "model": {"uri": f"s3://models/{name}", "servedName": name},
            "engine": {"kind": "reference"},
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi", "shmSize": "256Mi"},
            "replicas": 1,
        },
    }


def ready(obj: dict[str, Any] | None) -> bool:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def sent(cluster: Cluster, start: int = 0, *, by_name: bool = False) -> Counter[str]:
    """The operator's requests (our client's and kopf's) from ``start``, by ``VERB plural[/sub]``
    (and `` name`` with ``by_name``; a GET of a collection is a LIST); watch streams left out."""
    counts: Counter[str] = Counter()
    for r in list(cluster.api)[start:]:
        agent = r.headers.get("User-Agent", "")
        if ("kvfleet" not in agent and "kopf" not in agent) or r.params.get("watch") == "true":
            continue
        verb = "LIST" if r.method.value == "GET" and r.name is None else r.method.value
        what = f"{verb} {getattr(r.resource, 'plural', r.resource)}"
        what += f"/{r.subresource}" if r.subresource else ""
        counts[f"{what} {r.name}" if by_name else what] += 1
    return counts


def child_writes(counts: Counter[str]) -> dict[str, int]:
    return {k: n for k, n in counts.items() if k.startswith(CHILD_WRITES)}


async def quiet(cluster: Cluster, window_s: float = 1.5, timeout_s: float = 30.0) -> None:
    """Until the operator has sent nothing for ``window_s`` (kopf's bookkeeping, queued nudges)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    count, since = sum(sent(cluster).values()), loop.time()
    while loop.time() - since < window_s:
        assert loop.time() < deadline, f"the operator kept sending: {sent(cluster)}"
        await asyncio.sleep(0.1)
        if (now := sum(sent(cluster).values())) != count:
            count, since = now, loop.time()


async def test_create_applies_each_child_once_and_nudges_and_resyncs_apply_nothing(
    cluster: Cluster, operator: RunningOperator
) -> None:
    start = len(list(cluster.api))
    names = [f"m{i}" for i in range(COUNT)]
    for name in names:
        await cluster.create_infd(infd(name))
    for name in names:
        await eventually(lambda n=name: cluster.get(DEPLOYMENTS, NS, f"{n}-engine"), what=f"{name}'s Deployment")
    await quiet(cluster)
    created = sent(cluster, start)
    assert child_writes(created) == {
        "PATCH configmaps": 2 * COUNT,
        "PATCH deployments": COUNT,
        "PATCH services": COUNT,
        "PATCH poddisruptionbudgets": COUNT,
    }, created
    per_name = child_writes(sent(cluster, start, by_name=True))
    assert set(per_name.values()) == {1}, per_name  # the spec and the pin ConfigMap once each
    # Never read: the children are applied from the watched body, and the status write carries its
    # resourceVersion as a precondition (nobody else wrote, so none is refused); later status
    # writes plan from the watched body or, until the watch delivers it, the operator's own write.
    assert created["GET inferencedeployments"] == 0, created

    # The Deployment controller reports the pods Ready: the rollout nudges (and the rollout
    # check) write status, without reading the object again, and apply no child.
    rolled = len(list(cluster.api))
    for name in names:
        await cluster.roll_out(NS, name, ready=1)
    for name in names:
        await eventually(lambda n=name: ready(cluster.get(INFD, NS, n)), what=f"{name} Ready")
    await quiet(cluster)
    after = sent(cluster, rolled)
    assert child_writes(after) == {}, after
    assert after["PATCH inferencedeployments/status"] == COUNT, after
    assert after["GET inferencedeployments"] == 0, after

    # Converged: several resyncs send no request at all.
    settled = len(list(cluster.api))
    await asyncio.sleep(operator.settings.resync_interval_s * 4)
    assert sent(cluster, settled) == Counter(), sent(cluster, settled)


@pytest.mark.parametrize("bound", [1, 3])
async def test_a_start_up_pass_finishes_deployments_in_turn(cluster: Cluster, bound: int) -> None:
    """Twelve deployments found at start-up, at most ``bound`` reconciles at once: when the k-th
    engine Deployment is applied, at most k - 1 + ``bound`` deployments have been begun (their spec
    ConfigMap, the first thing a reconcile applies; fewer than k have finished). Unbounded, all
    twelve were begun before the first Deployment was applied: the pass went breadth-first."""
    names = [f"m{i:02d}" for i in range(12)]
    for name in names:
        await cluster.create_infd(infd(name))
    start = len(list(cluster.api))
    # Timers far off: at one reconcile at a time, the fixture's 0.5 s resyncs of twelve deployments
    # would queue between the start-up reconciles (and a busy machine then passes the wait below).
    settings = operator_settings(max_concurrent_reconciles=bound, resync_interval_s=600, rollout_check_interval_s=600)
    running = await start_operator(cluster, settings)
    try:
        for name in names:
            await eventually(
                lambda n=name: cluster.get(DEPLOYMENTS, NS, f"{n}-engine"), timeout_s=60, what=f"{name}'s Deployment"
            )
        await quiet(cluster)
    finally:
        await stop_operator(running)
    begun: set[str] = set()
    begun_before: list[int] = []  # deployments begun when each engine Deployment was applied, in order
    for r in list(cluster.api)[start:]:
        if "kvfleet" not in r.headers.get("User-Agent", ""):
            continue
        plural = getattr(r.resource, "plural", r.resource)
        if r.method.value == "PATCH" and plural == "configmaps" and str(r.name).endswith("-engine-spec"):
            begun.add(str(r.name))
        elif r.method.value == "PATCH" and plural == "deployments" and not r.subresource:
            begun_before.append(len(begun))
    assert len(begun_before) == len(names), begun_before
    assert all(n <= k - 1 + bound for k, n in enumerate(begun_before, start=1)), begun_before
