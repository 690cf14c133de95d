"""Served names across namespaces: who keeps a name two deployments claim, qualified and bare model
names, and client scoping by the gateway's namespace header (docs/router.md, Namespaces)."""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from kvfleet.router.kubernetes_source import log_new_conflicts
from kvfleet.router.replicas import DeploymentView, NameConflict, StaticReplicaSource, resolve_claims
from kvfleet.router.settings import RouterSettings
from kvfleet.spec import RoutingSpec

from .conftest import Backend, running_router

HEADER = "X-Kvfleet-Namespace"


def view(namespace: str, name: str, served: str, created: int | None) -> DeploymentView:
    return DeploymentView(served, namespace, name, RoutingSpec(), (), created)


def test_the_oldest_claimant_keeps_a_served_name() -> None:
    # "aaa" sorts first but was created later: it must not take "llama" from "zzz".
    older, newer = view("zzz", "llama", "llama", 1_000), view("aaa", "llama", "llama", 2_000)
    snapshot, conflicts = resolve_claims([newer, older])
    assert list(snapshot) == ["zzz/llama"]
    assert conflicts == [NameConflict("llama", ("zzz", "llama"), ("aaa", "llama"))]
    # Same second: namespace/name decides; an undated claimant never displaces a dated one.
    tie = resolve_claims([view("b", "x", "m", 5), view("a", "y", "m", 5)])[0]
    assert list(tie) == ["a/m"]
    undated = resolve_claims([view("a", "x", "m", None), view("b", "y", "m", 9)])[0]
    assert list(undated) == ["b/m"]
    # Different served names in different namespaces all stay.
    assert sorted(resolve_claims([older, view("aaa", "q", "qwen", 3)])[0]) == ["aaa/qwen", "zzz/llama"]


def test_a_conflict_is_logged_once_while_it_stands(caplog: pytest.LogCaptureFixture) -> None:
    conflict = NameConflict("llama", ("zzz", "llama"), ("aaa", "llama"))
    with caplog.at_level(logging.WARNING, logger="kvfleet.router.kubernetes_source"):
        logged = log_new_conflicts([conflict], set())
        logged = log_new_conflicts([conflict], logged)
        logged = log_new_conflicts([], logged)  # resolved
        log_new_conflicts([conflict], logged)  # claimed again: logged again
    lines = [r.getMessage() for r in caplog.records]
    assert (
        lines
        == [
            "InferenceDeployment aaa/llama is not routed: served name 'llama' is already served by zzz/llama "
            "(the older claimant)"
        ]
        * 2
    )


def scoped_source(backend: Backend) -> StaticReplicaSource:
    source = StaticReplicaSource()
    for namespace, served in (("team-a", "alpha"), ("team-b", "beta"), ("platform", "shared")):
        source.set_deployment(served, namespace=namespace, routing=RoutingSpec(prefix_block_chars=16))
        source.add(served, f"{served}-0", backend.url)
    return source


async def call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None, namespace: str | None = None
) -> tuple[int, Any]:
    headers = {HEADER: namespace} if namespace is not None else {}
    async with session.request(method, url, json=body, headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


async def test_qualified_names_are_exact_and_reach_the_engine_as_its_served_name(backends: list[Backend]) -> None:
    async with running_router(scoped_source(backends[0])) as router, aiohttp.ClientSession() as session:
        url = router.url + "/v1/completions"
        status, answer = await call(session, "POST", url, {"model": "team-a/alpha", "prompt": "hi"})
        assert (status, answer["model"]) == (200, "alpha")  # the engine saw the served name
        status, answer = await call(session, "POST", url, {"model": "alpha", "prompt": "hi"})
        assert (status, answer["model"]) == (200, "alpha")
        # A qualified name never falls back to another namespace's deployment of that served name.
        status, answer = await call(session, "POST", url, {"model": "team-b/alpha", "prompt": "hi"})
        assert status == 404 and answer["error"]["message"] == "model 'team-b/alpha' is not served here"
        status, card = await call(session, "GET", router.url + "/v1/models/team-a/alpha")
        assert (status, card["id"], card["root"]) == (200, "alpha", "alpha")
        metrics = router.metrics.render().decode()
    assert 'kvfleet_router_requests_total{code="200",model="alpha",namespace="team-a"} 2.0' in metrics
    assert 'kvfleet_router_requests_total{code="404",model="",namespace=""} 1.0' in metrics


async def test_clients_reach_only_their_namespace_and_the_shared_ones(backends: list[Backend]) -> None:
    scoping = {"client_namespace_header": HEADER, "shared_namespaces": ("platform",)}
    async with (
        running_router(scoped_source(backends[0]), **scoping) as router,
        aiohttp.ClientSession() as session,
    ):
        url = router.url + "/v1/completions"
        # Without the gateway's header: refused before any model is looked up, with the reason.
        for method, path, body in (("POST", "/v1/completions", {"model": "alpha"}), ("GET", "/v1/models", None)):
            status, answer = await call(session, method, router.url + path, body)
            assert status == 403, answer
            assert answer["error"]["message"] == (
                f"header {HEADER!r} is missing: requests must come through the gateway that sets it"
            )
            assert answer["error"]["code"] == "client_namespace_required"
        status, answer = await call(session, "POST", url, {"model": "alpha"}, namespace="Not A Namespace")
        assert status == 403 and "does not hold a Kubernetes namespace name" in answer["error"]["message"]

        status, listing = await call(session, "GET", router.url + "/v1/models", namespace="team-a")
        assert status == 200 and [m["id"] for m in listing["data"]] == ["alpha", "shared"]
        for model in ("alpha", "team-a/alpha", "shared", "platform/shared"):
            status, answer = await call(session, "POST", url, {"model": model, "prompt": "hi"}, namespace="team-a")
            assert status == 200, (model, answer)
        # Another namespace's model answers exactly as a model that does not exist: no leak of its existence.
        status, unknown = await call(session, "POST", url, {"model": "nope", "prompt": "hi"}, namespace="team-a")
        for model in ("beta", "team-b/beta"):
            status, answer = await call(session, "POST", url, {"model": model, "prompt": "hi"}, namespace="team-a")
            assert status == 404
            assert answer == json.loads(json.dumps(unknown).replace("'nope'", repr(model)))
            status, card = await call(session, "GET", router.url + f"/v1/models/{model}", namespace="team-a")
            assert status == 404 and card["error"]["code"] == "model_not_found"
        status, answer = await call(session, "POST", url, {"model": "beta", "prompt": "hi"}, namespace="team-b")
        assert status == 200


def test_scoping_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="shared_namespaces: only used with client_namespace_header"):
        RouterSettings(shared_namespaces=("platform",))
    with pytest.raises(ValidationError, match="'Bad_NS' is not a Kubernetes namespace name"):
        RouterSettings(client_namespace_header=HEADER, shared_namespaces=("Bad_NS",))
    with pytest.raises(ValidationError, match="client_namespace_header"):
        RouterSettings(client_namespace_header="X Bad: header")
