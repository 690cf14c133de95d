"""A wake starts GPUs: with a token file, the autoscaler's /v1/wake takes it only from the routers
(the router's own HttpWakeSignal against the autoscaler's own app, over real sockets)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.autoscaler.metrics import AutoscalerMetrics
from kvfleet.autoscaler.server import build_app, start_server
from kvfleet.autoscaler.wake import WakeInbox, WakeToken
from kvfleet.router.wake import HttpWakeSignal, WakeError


async def test_wake_needs_the_token_and_a_rotated_token_takes_effect(tmp_path: Path) -> None:
    secret = tmp_path / "autoscaler-token"
    secret.write_text("s3cr3t-token\n")
    inbox = WakeInbox()
    runner, port = await start_server(build_app(inbox, AutoscalerMetrics(), WakeToken(secret)), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    router_token = tmp_path / "router-token"
    router_token.write_text("s3cr3t-token")
    anonymous, wrong, router = (
        HttpWakeSignal(url, timeout_s=2),
        HttpWakeSignal(url, timeout_s=2, token_file=tmp_path / "wrong"),
        HttpWakeSignal(url, timeout_s=2, token_file=router_token),
    )
    (tmp_path / "wrong").write_text("guess")
    try:
        with pytest.raises(WakeError, match="401"):
            await anonymous.wake("team-a", "llama")
        with pytest.raises(WakeError, match="401"):
            await wrong.wake("team-a", "llama")
        assert inbox.take() == set()  # neither reached the control loop
        await router.wake("team-a", "llama")
        assert inbox.take() == {("team-a", "llama")}
        secret.write_text("rotated")  # the Secret changed: the old token stops working at once
        with pytest.raises(WakeError, match="401"):
            await router.wake("team-a", "llama")
        router_token.write_text("rotated")
        await router.wake("team-a", "llama")
        assert inbox.take() == {("team-a", "llama")}
    finally:
        for signal in (anonymous, wrong, router):
            await signal.close()
        await runner.cleanup()


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        WakeToken(tmp_path / "t").read()
