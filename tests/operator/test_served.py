"""The operator's start waits until InferenceDeployments are served (operator/served.py), against a
real HTTP server: a 429 ("storage is (re)initializing", a real API server's answer right after the
CRD is created) or a 5xx is asked again after the back-off, a 403 ends the start with its reason,
and a namespaced operator asks in each of its namespaces."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvfleet.kube import KubeClient, KubeError
from kvfleet.kube.backoff import Backoff
from kvfleet.operator.served import wait_until_served

FAST = Backoff(0.01, 0.05)


@pytest.fixture
async def server(free_port: int) -> AsyncIterator[tuple[str, list[str], list[int]]]:
    """Answers each GET with the next status of ``answers`` (then 200 with an empty list)."""
    calls: list[str] = []
    answers: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        calls.append(request.path_qs)
        status = answers.pop(0) if answers else 200
        if status != 200:
            body = {"kind": "Status", "code": status, "message": "storage is (re)initializing"}
            return web.json_response(body, status=status, headers={"Retry-After": "0"})
        return web.json_response({"kind": "List", "metadata": {"resourceVersion": "1"}, "items": []})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    try:
        yield f"http://127.0.0.1:{free_port}", calls, answers
    finally:
        await runner.cleanup()


async def test_a_crd_still_initializing_is_waited_for(server: tuple[str, list[str], list[int]]) -> None:
    url, calls, answers = server
    answers += [429, 429, 503]
    async with KubeClient.for_server(url) as client:
        await wait_until_served(client, backoff=FAST)
    assert calls == ["/apis/kvfleet.io/v1alpha1/inferencedeployments?limit=1"] * 4


async def test_a_forbidden_list_ends_the_start_at_once(server: tuple[str, list[str], list[int]]) -> None:
    url, calls, answers = server
    answers += [403]
    async with KubeClient.for_server(url) as client:
        with pytest.raises(KubeError, match="403"):
            await wait_until_served(client, backoff=FAST)
    assert len(calls) == 1


async def test_retries_are_bounded(server: tuple[str, list[str], list[int]]) -> None:
    url, calls, answers = server
    answers += [503] * 10
    async with KubeClient.for_server(url) as client:
        with pytest.raises(KubeError, match="503"):
            await wait_until_served(client, attempts=3, backoff=FAST)
    assert len(calls) == 3


async def test_a_namespaced_operator_asks_in_each_namespace(server: tuple[str, list[str], list[int]]) -> None:
    url, calls, _ = server
    async with KubeClient.for_server(url) as client:
        await wait_until_served(client, ("team-a", "team-b"), backoff=FAST)
    assert calls == [
        "/apis/kvfleet.io/v1alpha1/namespaces/team-a/inferencedeployments?limit=1",
        "/apis/kvfleet.io/v1alpha1/namespaces/team-b/inferencedeployments?limit=1",
    ]
