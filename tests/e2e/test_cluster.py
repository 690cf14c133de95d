"""End to end on a real Kubernetes cluster: CRD + operator, examples/tiny.yaml, Ready, a completion.

Needs a cluster: ``KVFLEET_E2E_KUBECONFIG`` (any cluster you may create namespaces in), or kind with
a running Docker engine (a throwaway cluster is created and deleted). It also needs the CPU engine
image (``KVFLEET_E2E_ENGINE_IMAGE``, built from engine_image/) and the shared router installed by
the chart (Service ``kvfleet-router`` in ``KVFLEET_E2E_ROUTER_NAMESPACE``, default kvfleet-system).
The operator runs in this process against the cluster, the way ``kvfleet operator run`` does.
Where any of that is missing the test skips and says which part.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import pick_free_port

from kvfleet.operator.runner import run_operator
from kvfleet.operator.settings import OperatorSettings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
KIND_CLUSTER = "kvfleet-e2e"


def _docker_running() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    given = os.environ.get("KVFLEET_E2E_KUBECONFIG")
    if given:
        yield given
        return
    if shutil.which("kind") is None or not _docker_running():
        pytest.skip(
            "no cluster: set KVFLEET_E2E_KUBECONFIG, or install kind with a running Docker engine "
            "(this machine has no Docker engine)"
        )
    path = str(tmp_path_factory.mktemp("kind") / "kubeconfig")
    subprocess.run(
        ["kind", "create", "cluster", "--name", KIND_CLUSTER, "--kubeconfig", path, "--wait", "120s"],
        check=True,
        timeout=600,
    )
    try:
        yield path
    finally:
        subprocess.run(["kind", "delete", "cluster", "--name", KIND_CLUSTER], timeout=300)


def kubectl(kubeconfig: str, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, *args], input=stdin, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def get_infd(kubeconfig: str, ns: str, name: str) -> dict[str, Any]:
    return dict(json.loads(kubectl(kubeconfig, "-n", ns, "get", "infd", name, "-o", "json")))


def wait_for(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def test_tiny_gets_ready_and_answers_through_the_router(kubeconfig: str) -> None:
    image = os.environ.get("KVFLEET_E2E_ENGINE_IMAGE")
    if not image:
        pytest.skip("KVFLEET_E2E_ENGINE_IMAGE (the CPU engine image from engine_image/) is not set")
    router_ns = os.environ.get("KVFLEET_E2E_ROUTER_NAMESPACE", "kvfleet-system")
    if (
        subprocess.run(
            ["kubectl", "--kubeconfig", kubeconfig, "-n", router_ns, "get", "svc", "kvfleet-router"],
            capture_output=True,
            timeout=60,
        ).returncode
        != 0
    ):
        pytest.skip(f"the shared router (svc/kvfleet-router in {router_ns}) is not installed; install the chart")

    ns = f"kvfleet-e2e-{os.getpid()}"
    kubectl(kubeconfig, "apply", "-f", str(REPO / "crds"))
    kubectl(kubeconfig, "create", "namespace", ns)
    os.environ["KUBECONFIG"] = kubeconfig
    stop, ready = threading.Event(), threading.Event()
    settings = OperatorSettings(
        namespaces=(ns,), resync_interval_s=5, router_endpoint=f"http://kvfleet-router.{router_ns}.svc/v1"
    )
    operator = threading.Thread(
        target=lambda: asyncio.run(run_operator(settings, stop_flag=stop, ready_flag=ready)), daemon=True
    )
    operator.start()
    port_forward: subprocess.Popen[str] | None = None
    try:
        assert ready.wait(60), "the operator did not start"
        doc = copy.deepcopy(yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text()))
        doc["metadata"]["namespace"] = ns
        doc["spec"]["engine"]["image"] = image
        kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(doc))
        # tiny scales to zero; ask for one replica the way the autoscaler does (status, not spec).
        kubectl(
            kubeconfig,
            "-n",
            ns,
            "patch",
            "infd",
            "tiny",
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"desiredReplicas": 1}}),
        )
        infd = wait_for(
            lambda: (o := get_infd(kubeconfig, ns, "tiny")) and (o["status"].get("readyReplicas") or 0) >= 1 and o,
            600,
            "a ready replica",
        )
        ready_cond = next(c for c in infd["status"]["conditions"] if c["type"] == "Ready")
        assert ready_cond["status"] == "True"
        local_port = pick_free_port()
        port_forward = subprocess.Popen(
            [
                "kubectl",
                "--kubeconfig",
                kubeconfig,
                "-n",
                router_ns,
                "port-forward",
                "--address",
                "127.0.0.1",
                "svc/kvfleet-router",
                f"{local_port}:80",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)

        async def complete() -> dict[str, Any]:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{local_port}/v1/completions",
                    json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                ) as response,
            ):
                assert response.status == 200, await response.text()
                return dict(await response.json())

        answer = asyncio.run(complete())
        assert answer["choices"][0]["text"] is not None
    finally:
        if port_forward is not None:
            port_forward.terminate()
            port_forward.wait(10)
        subprocess.run(
            ["kubectl", "--kubeconfig", kubeconfig, "delete", "namespace", ns, "--wait=false"],
            capture_output=True,
            timeout=120,
        )
        stop.set()
        operator.join(30)
