"""A status write planned from a watched body carries that body's resourceVersion as a precondition
(operator/reconcile.py): one request when the body was current; on a 409 the object is read afresh
and the status planned again. Children come from memory here, so the only requests are these."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from kvfleet.kube import KubeConflict, Ref
from kvfleet.operator.child_cache import typed
from kvfleet.operator.reconcile import Reconciler
from kvfleet.operator.render import Owner, render_children
from kvfleet.validation import validate_spec
from kvfleet_testkit.kube_emulator import operator_settings
from kvfleet_testkit.manifests import inference_deployment

NS, NAME = "team", "m0"
KINDS = {
    "deployments": "Deployment",
    "configmaps": "ConfigMap",
    "services": "Service",
    "poddisruptionbudgets": "PodDisruptionBudget",
}


def watched_body(version: str) -> dict[str, Any]:
    body = inference_deployment(NAME, NS, replicas=1)
    body["metadata"].update(uid="u1", generation=1, resourceVersion=version, creationTimestamp="2026-11-28T00:00:00Z")
    return body


class Children:
    """The converged children, as the watches' cache would hold them (ready: status is all that moves)."""

    def __init__(self) -> None:
        settings = operator_settings(coldstart_pods_per_tick=0)
        spec, _ = validate_spec(watched_body("1")["spec"])
        assert spec is not None
        self.store: dict[tuple[str, str], dict[str, Any]] = {}
        for child in render_children(Owner(NAME, NS, "u1"), spec, 1, settings, service_monitor=False):
            child = copy.deepcopy(child)
            if child["kind"] == "Deployment":
                child["metadata"]["generation"] = 1
                child["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1}
            self.store[(child["kind"], child["metadata"]["name"])] = child

    async def get_object(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.store.get((KINDS.get(ref.plural, ""), name))
        return typed(ref, found) if found is not None else None

    async def list_objects(self, ref: Ref, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        return []


class Api:
    """Answers the InferenceDeployment's GET and status patches; ``conflicts`` patches with a
    precondition are refused first (as the API server does once the object moved on)."""

    def __init__(self, conflicts: int) -> None:
        self.conflicts = conflicts
        self.calls: list[tuple[str, str | None]] = []

    async def serves(self, *_: Any) -> bool:
        return False

    async def get_object(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any]:
        self.calls.append(("GET", None))
        return watched_body("7")  # moved on: another writer's version

    async def patch_status(self, *_: Any, resource_version: str | None = None, **__: Any) -> dict[str, Any]:
        self.calls.append(("PATCH status", resource_version))
        if resource_version is not None and self.conflicts:
            self.conflicts -= 1
            raise KubeConflict("the object has been modified", 409)
        return watched_body("8")


async def reconcile(api: Api) -> list[str]:
    events: list[str] = []

    def post(_: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        events.append(reason)

    settings = operator_settings(coldstart_pods_per_tick=0, progress_pods_per_tick=0)
    r = Reconciler(api, settings, post_event=post, cache=Children())  # type: ignore[arg-type]
    outcome = await r.reconcile(NS, NAME, body=watched_body("5"))
    assert outcome.status_written and not outcome.applied
    return events


async def test_a_current_watched_body_costs_one_patch_and_no_read() -> None:
    api = Api(conflicts=0)
    events = await reconcile(api)
    assert api.calls == [("PATCH status", "5")]
    assert events  # the first status: its transitions posted once


async def test_a_moved_object_is_read_afresh_and_patched_again_once() -> None:
    api = Api(conflicts=1)
    events = await reconcile(api)
    assert api.calls == [("PATCH status", "5"), ("GET", None), ("PATCH status", None)]
    # The refused plan posted nothing: the Events are those of one clean write.
    assert events == await reconcile(Api(conflicts=0))


async def test_concurrent_reconciles_ask_discovery_once() -> None:
    """The ServiceMonitor discovery answer is shared: 16 reconciles running when it expires send
    one GET, not one each (every 5 minutes, most of a converged fleet's requests at 1,000)."""
    asked: list[int] = []

    class SlowDiscovery(Api):
        async def serves(self, *_: Any) -> bool:
            asked.append(1)
            await asyncio.sleep(0.05)  # in flight while the others arrive
            return False

    settings = operator_settings(coldstart_pods_per_tick=0, progress_pods_per_tick=0)
    r = Reconciler(SlowDiscovery(0), settings, post_event=lambda *_, **__: None, cache=Children())  # type: ignore[arg-type]
    # As 16 reconciles of different deployments reach it at once (one deployment's are serialized
    # by its own lock, so they cannot show it).
    answers = await asyncio.gather(*(r._serves_service_monitors() for _ in range(16)))
    assert answers == [False] * 16
    assert len(asked) == 1, asked
