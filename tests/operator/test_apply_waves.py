"""A reconcile applies its children in two waves, each wave's at once (operator/render.py
``apply_waves``): what the pods use (the ConfigMaps, the Service) first, then the Deployment with
the PodDisruptionBudget and the ServiceMonitor. A new deployment's reconcile costs two round trips
instead of six; a refused ConfigMap still stops the Deployment, a refused ServiceMonitor does not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfleet.kube import KubeError, KubeRejected, Ref
from kvfleet.operator.reconcile import Reconciler
from kvfleet.operator.render import DEPLOYMENT, Owner, apply_waves, kind_of, render_children
from kvfleet.validation import validate_spec
from kvfleet_testkit.kube_emulator import operator_settings
from kvfleet_testkit.manifests import inference_deployment

NS, NAME = "team", "m0"


def body(version: int = 5, max_model_len: int | None = None) -> dict[str, Any]:
    obj = inference_deployment(NAME, NS, replicas=2, max_model_len=max_model_len)
    obj["metadata"].update(
        uid="u1", generation=1, resourceVersion=str(version), creationTimestamp="2026-11-28T00:00:00Z"
    )
    return obj


def children(*, service_monitor: bool = True) -> list[dict[str, Any]]:
    spec, _ = validate_spec(body()["spec"])
    assert spec is not None
    settings = operator_settings(coldstart_pods_per_tick=0)
    return render_children(Owner(NAME, NS, "u1"), spec, 2, settings, service_monitor=service_monitor)


def kinds(waves: list[list[dict[str, Any]]]) -> list[list[str]]:
    return [[child["kind"] for child in wave] for wave in waves]


def test_what_the_pods_use_goes_first_and_the_rest_with_the_deployment() -> None:
    assert kinds(apply_waves(children(), kind_of)) == [
        ["ConfigMap", "ConfigMap", "Service"],
        ["Deployment", "PodDisruptionBudget", "ServiceMonitor"],
    ]
    # Only what differs is applied: a template change is one wave of one request.
    (deployment,) = [c for c in children() if kind_of(c) is DEPLOYMENT]
    assert kinds(apply_waves([deployment], kind_of)) == [["Deployment"]]
    assert apply_waves([], kind_of) == []


class Api:
    """The InferenceDeployment's GET and status patch, and applies that take ``latency_s`` each,
    recording how many were in flight; ``refuse`` and ``fail`` name kinds answered 422 and 500."""

    def __init__(self, refuse: tuple[str, ...] = (), fail: tuple[str, ...] = (), latency_s: float = 0.02) -> None:
        self.refuse, self.fail, self.latency_s = refuse, fail, latency_s
        self.current = body()  # what a GET answers
        self.reads = 0
        self.applied: list[str] = []  # kinds, in the order their applies ended
        self.in_flight: list[str] = []
        self.waves: list[list[str]] = []  # the kinds in flight together, each time one starts

    async def serves(self, *_: Any) -> bool:
        return True

    async def get_object(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any]:
        self.reads += 1
        return self.current

    async def apply(self, ref: Ref, obj: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        kind = obj["kind"]
        self.in_flight.append(kind)
        self.waves.append(list(self.in_flight))
        try:
            await asyncio.sleep(self.latency_s)
            if kind in self.refuse:
                raise KubeRejected("denied", 422, detail=f"{kind} denied by a webhook")
            if kind in self.fail:
                raise KubeError("internal error", 500)
        finally:
            self.in_flight.remove(kind)
        self.applied.append(kind)
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "9", "generation": 1}}

    async def patch_status(self, *_: Any, **__: Any) -> dict[str, Any]:
        return body()


class Cache:
    """The watches' cache of a deployment with no children yet; what is applied is remembered."""

    def __init__(self) -> None:
        self.remembered: list[str] = []
        self.store: dict[tuple[str, str], dict[str, Any]] = {}

    async def get_object(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.store.get((ref.plural, name))

    async def list_objects(self, ref: Ref, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        return []

    def remember(self, ref: Ref, obj: dict[str, Any]) -> None:
        self.remembered.append(obj["kind"])
        self.store[(ref.plural, obj["metadata"]["name"])] = obj


def reconciler(api: Api, cache: Cache) -> Reconciler:
    settings = operator_settings(coldstart_pods_per_tick=0, progress_pods_per_tick=0)
    return Reconciler(api, settings, post_event=lambda *_, **__: None, cache=cache)  # type: ignore[arg-type]


async def test_a_new_deployment_is_applied_in_two_round_trips() -> None:
    api, cache = Api(), Cache()
    outcome = await reconciler(api, cache).reconcile(NS, NAME)
    assert outcome.apply_error is None and len(outcome.applied) == 6
    # Every first-wave apply ended before the Deployment's began; each wave's went out together.
    deployment_started = next(i for i, wave in enumerate(api.waves) if "Deployment" in wave)
    assert sorted(api.applied[:3]) == ["ConfigMap", "ConfigMap", "Service"]
    assert all("Deployment" not in wave for wave in api.waves[:deployment_started])
    assert max(len(wave) for wave in api.waves) == 3
    everything = ["ConfigMap", "ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceMonitor"]
    assert sorted(cache.remembered) == everything


async def test_a_refused_configmap_stops_the_deployment() -> None:
    api = Api(refuse=("ConfigMap",))
    outcome = await reconciler(api, Cache()).reconcile(NS, NAME)
    assert outcome.apply_error is not None and outcome.apply_error.startswith("ConfigMap "), outcome
    assert "ConfigMap denied by a webhook" in outcome.apply_error
    assert "Deployment" not in api.applied
    assert outcome.status_written  # Degraded=ApplyFailed says which child and why


async def test_a_refused_service_monitor_does_not_stop_the_deployment() -> None:
    api = Api(refuse=("ServiceMonitor",))
    outcome = await reconciler(api, Cache()).reconcile(NS, NAME)
    assert outcome.apply_error is not None and outcome.apply_error.startswith("ServiceMonitor "), outcome
    assert "Deployment" in api.applied and "PodDisruptionBudget" in api.applied


async def test_a_failed_apply_is_raised_after_its_wave_and_the_rest_is_remembered() -> None:
    """A 500 on one child fails the reconcile (the periodic looks retry it), but only once the
    wave's other requests ended: what they wrote is kept, so the retry does not send it again."""
    api, cache = Api(fail=("PodDisruptionBudget",)), Cache()
    with pytest.raises(KubeError, match="internal error"):
        await reconciler(api, cache).reconcile(NS, NAME)
    assert "Deployment" in cache.remembered and "ServiceMonitor" in cache.remembered
    assert "PodDisruptionBudget" not in cache.remembered


async def test_children_are_applied_from_the_watched_body_without_a_read() -> None:
    api = Api()
    outcome = await reconciler(api, Cache()).reconcile(NS, NAME, body=body())
    assert len(outcome.applied) == 6 and outcome.status_written
    assert api.reads == 0


async def test_a_watched_body_older_than_one_acted_on_is_read_afresh_not_applied() -> None:
    """An event queued behind a reconcile that read a newer spec: applying from it would roll the
    engines back to the replaced spec (and forward again after the status write's 409)."""
    api, cache = Api(), Cache()
    r = reconciler(api, cache)
    api.current = body(version=10, max_model_len=4096)
    await r.reconcile(NS, NAME)  # a look without a body: reads version 10
    template = cache.store[("deployments", f"{NAME}-engine")]["spec"]["template"]
    applied, reads = len(api.applied), api.reads
    outcome = await r.reconcile(NS, NAME, body=body(version=9))  # the older spec, late
    assert api.reads == reads + 1, "the stale body was not read afresh"
    assert outcome.applied == [] and len(api.applied) == applied, outcome
    assert cache.store[("deployments", f"{NAME}-engine")]["spec"]["template"] == template
