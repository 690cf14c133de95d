"""The whole autoscaler: in Kubernetes mode against KMock and a real Prometheus, and the CLI's
refusal of ``--mode local`` (local mode is ``kvfleet local up``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from kvfleet.autoscaler.runner import run_autoscaler
from kvfleet.autoscaler.settings import AutoscalerSettings
from tests.autoscaler.conftest import MODEL, Kube, MetricsEndpoint, PrometheusServer
from tests.conftest import pick_free_port

pytestmark = pytest.mark.slow

SPEC = {
    "model": {"uri": "s3://models/tiny", "servedName": MODEL},
    "engine": {"kind": "reference"},
    "resources": {"gpus": 0},
    "autoscaling": {"minReplicas": 1, "maxReplicas": 5, "targetConcurrencyPerReplica": 16},
}
IDLE_SPEC = {
    "model": {"uri": "s3://models/other", "servedName": "idle-model"},
    "engine": {"kind": "reference"},
    "resources": {"gpus": 0},
    "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 60},
}


async def until(check: Callable[[], bool], what: str, timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_kubernetes_mode_scales_wakes_and_leads(
    kube: Kube, metrics_endpoint: MetricsEndpoint, prometheus: PrometheusServer
) -> None:
    kube.add_deployment("chat", SPEC, status={"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1})
    kube.add_deployment("idle", IDLE_SPEC, status={"replicas": 0, "readyReplicas": 0, "desiredReplicas": 0})
    metrics_endpoint.running.labels(MODEL).set(25)
    metrics_endpoint.waiting.labels(MODEL).set(7)  # 32 in flight / 16 per replica -> 2
    metrics_endpoint.queue.labels("default", MODEL).set(0)
    settings = AutoscalerSettings(
        mode="kubernetes",
        prometheus_url=prometheus.url,
        listen_host="127.0.0.1",
        listen_port=0,
        tick_interval_s=5.0,
        identity="autoscaler-0",
        lease_namespace="default",
    )
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_autoscaler(settings, stop, api=kube.api(), ready=ready))
    try:
        port = await asyncio.wait_for(ready, 10)
        await until(lambda: kube.deployment("chat")["status"].get("desiredReplicas") == 2, "chat to scale to 2")
        status = kube.deployment("chat")["status"]
        assert status["scaleReason"].startswith("scale_up: concurrency: load 32.0")
        assert kube.deployment("chat")["spec"] == SPEC
        assert kube.lease()["spec"]["holderIdentity"] == "autoscaler-0"

        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{port}"
            async with http.post(f"{base}/v1/wake", data=b"{nope") as r:
                assert r.status == 400 and "not JSON" in (await r.json())["error"]
            # As deep as the 4 KiB body allows: past the parser's depth ("not JSON"), or, where something in
            # the process raised the recursion limit, parsed into a list ("a JSON object"); a 400 either way.
            async with http.post(f"{base}/v1/wake", data=b"[" * 2040 + b"]" * 2040) as r:
                reason = (await r.json())["error"]
                assert r.status == 400 and ("not JSON" in reason or "must be a JSON object" in reason), reason
            async with http.post(f"{base}/v1/wake", json={"namespace": "default", "name": "Bad_Name"}) as r:
                assert r.status == 400 and "name must be a DNS-1035 label" in (await r.json())["error"]
            woken_at = time.monotonic()
            async with http.post(f"{base}/v1/wake", json={"namespace": "default", "name": "idle"}) as r:
                assert r.status == 202
            # Within one loop tick (5 s here) at most; in practice at once.
            await until(lambda: kube.deployment("idle")["status"].get("desiredReplicas") == 1, "wake", 4.5)
            assert time.monotonic() - woken_at < 4.5
            assert kube.deployment("idle")["status"]["scaleReason"].startswith("wake: router wake signal")
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
        assert 'kvfleet_autoscaler_desired_replicas{model="tiny-chat",namespace="default"} 2.0' in text
        assert 'kvfleet_autoscaler_decisions_total{model="idle-model",namespace="default",reason="wake"} 1.0' in text
        assert "kvfleet_autoscaler_is_leader 1.0" in text
        # Watched, not listed per tick: one LIST for the whole run.
        assert 'kvfleet_autoscaler_kube_watch_total{event="lists",resource="inferencedeployments"} 1.0' in text
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    # Stopping released the Lease for a standby to take at once.
    assert kube.lease()["spec"].get("holderIdentity") is None


def test_cli_refuses_local_mode_and_names_kvfleet_local_up(tmp_path: Path, repo_root: Path) -> None:
    """``--mode local`` used to decide for deployments whose engines nothing started; it is refused
    with the command that runs this loop locally, before anything listens."""
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text((repo_root / "examples" / "tiny.yaml").read_text())
    port = pick_free_port()
    base = [
        sys.executable,
        "-m",
        "kvfleet.cli",
        "autoscaler",
        "run",
        "--listen-host=127.0.0.1",
        f"--listen-port={port}",
    ]
    for extra in (["--mode=local", f"--filename={manifest}"], ["--mode=local"], ["--router-url=http://127.0.0.1:1"]):
        result = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, (extra, result.stdout, result.stderr)
        assert "kvfleet local up -f FILE" in result.stderr and "refused" in result.stderr, result.stderr


def test_cli_rejects_bad_settings() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "autoscaler", "run", "--tick-interval-s=0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid setting loop: tick_interval_s must be in [0.05, 60.0], got 0.0" in result.stderr
