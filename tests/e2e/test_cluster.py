"""End to end on a real Kubernetes cluster: the chart's operator, router and autoscaler,
examples/tiny.yaml with the CPU engine image, Ready, a completion through the router's Service.

One test body, three ways to get the cluster (the ``cluster`` fixture):

- ``KVFLEET_E2E_KUBECONFIG``: any cluster you may create namespaces in, with the chart installed
  (Service ``kvfleet-router`` in ``KVFLEET_E2E_ROUTER_NAMESPACE``, default kvfleet-system), the CPU
  engine image in ``KVFLEET_E2E_ENGINE_IMAGE`` and the model where pods reach it
  (``KVFLEET_E2E_MODEL_URI``; with an S3 URI, ``KVFLEET_E2E_S3_ENDPOINT`` and the credentials'
  Secret ``KVFLEET_E2E_S3_SECRET``, copied into the test's namespace by name);
- kind where a Docker engine runs: a throwaway cluster, then as above;
- otherwise the real node here (tests/support/node_fixtures.py, the session's one cluster): the
  chart from the repository's image, the engine image built from engine_image/, the model in a
  real S3 server.

Where a part is missing the test skips and says which.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import pick_free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3000)]
REPO = Path(__file__).resolve().parents[2]
KIND_CLUSTER = "kvfleet-e2e"
ROUTER_SERVICE = "kvfleet-router"


@dataclass(frozen=True)
class E2ECluster:
    kubeconfig: str
    engine_image: str
    router_namespace: str
    model: dict[str, Any]  # spec.model's uri
    cache: dict[str, Any]  # spec.cache (empty: the spec's default)
    router: Callable[[], AbstractContextManager[str]]  # the router's base URL from here
    prepare_namespace: Callable[[str], None] = lambda namespace: None
    spec_overrides: dict[str, Any] = field(default_factory=dict)


def _docker_running() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def kubectl(kubeconfig: str, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, *args], input=stdin, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _port_forward(kubeconfig: str, namespace: str) -> Callable[[], AbstractContextManager[str]]:
    @contextmanager
    def router() -> Iterator[str]:
        port = pick_free_port()
        argv = ["kubectl", "--kubeconfig", kubeconfig, "-n", namespace, "port-forward", "--address", "127.0.0.1"]
        forward = subprocess.Popen([*argv, f"svc/{ROUTER_SERVICE}", f"{port}:80"], stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(3)
            yield f"http://127.0.0.1:{port}"
        finally:
            forward.terminate()
            forward.wait(10)

    return router


def _given_cluster(kubeconfig: str) -> E2ECluster:
    """A cluster someone else runs, with the chart, the engine image and the model in place."""
    image = os.environ.get("KVFLEET_E2E_ENGINE_IMAGE")
    uri = os.environ.get("KVFLEET_E2E_MODEL_URI")
    if not image or not uri:
        pytest.skip(
            "set KVFLEET_E2E_ENGINE_IMAGE (the CPU engine image) and KVFLEET_E2E_MODEL_URI (where pods find it)"
        )
    router_ns = os.environ.get("KVFLEET_E2E_ROUTER_NAMESPACE", "kvfleet-system")
    found = subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, "-n", router_ns, "get", "svc", ROUTER_SERVICE],
        capture_output=True,
        timeout=60,
    )
    if found.returncode != 0:
        pytest.skip(f"the chart is not installed (svc/{ROUTER_SERVICE} in {router_ns}); install it")
    cache: dict[str, Any] = {}
    secret = os.environ.get("KVFLEET_E2E_S3_SECRET")
    if os.environ.get("KVFLEET_E2E_S3_ENDPOINT"):
        cache = {"s3Endpoint": os.environ["KVFLEET_E2E_S3_ENDPOINT"], "credentialsSecret": secret}

    def prepare(namespace: str) -> None:
        if secret:
            source = json.loads(kubectl(kubeconfig, "-n", router_ns, "get", "secret", secret, "-o", "json"))
            copied = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": namespace}}
            kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps({**copied, "data": source["data"]}))

    return E2ECluster(kubeconfig, image, router_ns, {"uri": uri}, cache, _port_forward(kubeconfig, router_ns), prepare)


def _real_node_cluster(request: pytest.FixtureRequest) -> E2ECluster:
    """The session's real node with the chart, the engine image and the model in S3."""
    from support.node_fixtures import SECRET, S3Model, s3_credentials
    from support.real_node import RealNodeCluster

    node: RealNodeCluster = request.getfixturevalue("real_node")
    model: S3Model = request.getfixturevalue("engine_ready")
    image: str = request.getfixturevalue("engine_image")
    router_ns: str = request.getfixturevalue("chart")

    @contextmanager
    def router() -> Iterator[str]:
        yield node.node["router"]  # `up --real-node` forwards it to the host's loopback

    return E2ECluster(
        kubeconfig=str(node.root / "kubeconfig"),
        engine_image=image,
        router_namespace=router_ns,
        model={"uri": model.uri},
        cache={"s3Endpoint": model.endpoint_in_node, "region": model.server.region, "credentialsSecret": SECRET},
        router=router,
        prepare_namespace=lambda namespace: s3_credentials(node, model, namespace),
        # Beside the chart's pods on a 2-core node (docs/operator.md, "A real node").
        spec_overrides={"resources": {"cpu": "400m"}},
    )


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    given = os.environ.get("KVFLEET_E2E_KUBECONFIG")
    if given:
        yield _given_cluster(given)
        return
    if shutil.which("kind") is None or not _docker_running():
        # No Docker engine here: the real node (it skips, saying why, where it cannot run).
        yield _real_node_cluster(request)
        return
    path = str(tmp_path_factory.mktemp("kind") / "kubeconfig")
    subprocess.run(
        ["kind", "create", "cluster", "--name", KIND_CLUSTER, "--kubeconfig", path, "--wait", "120s"],
        check=True,
        timeout=600,
    )
    try:
        yield _given_cluster(path)
    finally:
        subprocess.run(["kind", "delete", "cluster", "--name", KIND_CLUSTER], timeout=300)


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


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def test_tiny_gets_ready_and_answers_through_the_router(cluster: E2ECluster) -> None:
    kubeconfig = cluster.kubeconfig
    ns = f"kvfleet-e2e-{os.getpid()}"
    kubectl(kubeconfig, "create", "namespace", ns)
    try:
        cluster.prepare_namespace(ns)
        doc = copy.deepcopy(yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text()))
        doc["metadata"] = {"name": "tiny", "namespace": ns}  # no make-tiny-model: local mode's
        doc["spec"]["engine"]["image"] = cluster.engine_image
        doc["spec"]["model"] = {**cluster.model, "servedName": "tiny"}
        if cluster.cache:
            doc["spec"]["cache"] = cluster.cache
        # A cold start on a small node: a pod start, torch's import and the pull.
        doc["spec"]["autoscaling"]["coldStartSeconds"] = 120
        doc["spec"]["routing"]["maxQueueWaitSeconds"] = 300
        doc["spec"] = _merge(doc["spec"], cluster.spec_overrides)
        kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(doc))
        # tiny scales to zero; ask for one replica the way the autoscaler does (status, not spec).
        kubectl(
            kubeconfig,
            *("-n", ns, "patch", "infd", "tiny", "--subresource=status", "--type=merge"),
            *("-p", json.dumps({"status": {"desiredReplicas": 1}})),
        )
        infd = wait_for(
            lambda: (o := get_infd(kubeconfig, ns, "tiny")) and (o["status"].get("readyReplicas") or 0) >= 1 and o,
            600,
            "a ready replica",
        )
        ready_cond = next(c for c in infd["status"]["conditions"] if c["type"] == "Ready")
        assert ready_cond["status"] == "True"

        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
        with cluster.router() as base:
            request = urllib.request.Request(
                f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=420) as response:
                assert response.status == 200
                answer = json.loads(response.read())
        assert answer["choices"][0]["text"] is not None
    finally:
        subprocess.run(
            ["kubectl", "--kubeconfig", kubeconfig, "delete", "namespace", ns, "--wait=false"],
            capture_output=True,
            timeout=120,
        )
