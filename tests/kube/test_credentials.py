"""``KubeClient``'s credentials (kvfleet/kube/credentials.py): lightkube's auth flow driven by hand
for aiohttp. A 401 renews what can be renewed (a rotated ``tokenFile`` read again) and sends the
request once more; a fixed token's 401 reaches the caller, after one request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from support.kubeconfig import write_kubeconfig

from kvfleet.kube import KubeClient, KubeError, load_config

IDS = "/apis/kvfleet.io/v1alpha1/inferencedeployments"


class OneTokenServer:
    """Answers 200 to ``Bearer <accepted>`` and 401 (a Status) to anything else; keeps what came."""

    def __init__(self, accepted: str) -> None:
        self.accepted = accepted
        self.seen: list[str | None] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") == f"Bearer {self.accepted}":
            return web.json_response({"kind": "InferenceDeploymentList", "items": []})
        status = {"kind": "Status", "reason": "Unauthorized", "message": "token refused", "code": 401}
        return web.json_response(status, status=401)


@pytest.fixture
async def server() -> AsyncIterator[tuple[OneTokenServer, str]]:
    app_server = OneTokenServer("second")
    app = web.Application()
    app.router.add_get(IDS, app_server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield app_server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_rotated_token_file_is_read_again_on_a_401(server: tuple[OneTokenServer, str], tmp_path: Path) -> None:
    api, url = server
    token = tmp_path / "token"
    token.write_text("first\n")
    config = load_config(str(write_kubeconfig(tmp_path, url, {"tokenFile": str(token)})))
    async with KubeClient(config, timeout_s=5) as client:
        api.accepted = "first"
        await client.get(IDS)
        token.write_text("second\n")  # rotated (the kubelet renews a service account's token)
        api.accepted = "second"
        await client.get(IDS)
        await client.get(IDS)
    assert api.seen == ["Bearer first", "Bearer first", "Bearer second", "Bearer second"]


async def test_a_fixed_tokens_401_reaches_the_caller_after_one_request(
    server: tuple[OneTokenServer, str], tmp_path: Path
) -> None:
    api, url = server
    config = load_config(str(write_kubeconfig(tmp_path, url, {"token": "wrong"})))
    async with KubeClient(config, timeout_s=5) as client:
        with pytest.raises(KubeError) as caught:
            await client.get(IDS)
    assert (caught.value.status, caught.value.retryable, caught.value.detail) == (401, False, "token refused")
    assert api.seen == ["Bearer wrong"]
