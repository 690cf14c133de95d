"""The chart on the real node with the image built from the repository's own Dockerfile (buildah,
a Debian base from mmdebstrap; no registry): the operator, router and autoscaler pods really run,
go Ready through their probes, log no error, and the router answers through its Service from the
host's loopback (the address `up --real-node` prints)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from support.real_cluster import wait_for
from support.real_node import RealNodeCluster

from kvfleet.devcluster.realnode.settings import NODE_NAME

# A cold run builds the control-plane image (6-10 min on a busy 2-core machine) in the first
# test's fixtures.
pytestmark = pytest.mark.timeout(1800)

NAMESPACE = "kvfleet-system"
ERROR_MARKS = ("Traceback", " ERROR ", "level=error", "CRITICAL")


def test_helm_install_runs_the_control_plane_pods(real_node: RealNodeCluster, chart: str) -> None:
    kubectl = real_node.kubectl
    pods = kubectl.json("get", "pods", "-n", NAMESPACE)["items"]
    assert {p["spec"]["nodeName"] for p in pods} == {NODE_NAME}
    for pod in pods:
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and status["restartCount"] == 0, (pod["metadata"]["name"], status)
        assert status["imageID"] and status["image"].startswith("kvfleet.local/kvfleet:")
        log = kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"])
        assert not [line for line in log.splitlines() if any(m in line for m in ERROR_MARKS)], log[-3000:]

    # From the host: the printed address forwards into the node's namespace, to the router's Service.
    def router_health() -> int | None:
        try:
            with urllib.request.urlopen(f"{real_node.node['router']}/health", timeout=5) as response:
                return int(response.status)
        except OSError:
            return None

    assert wait_for(router_health, 60, "the router's /health through its Service") == 200
    with urllib.request.urlopen(f"{real_node.node['router']}/v1/models", timeout=5) as response:
        assert "data" in json.loads(response.read())


def test_the_router_reaches_the_autoscaler_by_its_service_name(real_node: RealNodeCluster, chart: str) -> None:
    """The router's wake URL names the autoscaler's Service (`...svc`): from the router's pod it
    resolves through the node's CoreDNS and answers over the pod network; a wake without the
    shared token is refused there, not lost on the way."""
    kubectl = real_node.kubectl
    (router, *_) = kubectl.json("get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=router")["items"]
    (url,) = [a.split("=", 1)[1] for a in router["spec"]["containers"][0]["args"] if a.startswith("--autoscaler-url=")]
    assert ".svc:" in url, url
    probe = (
        "import sys, urllib.request, urllib.error\n"
        "print(urllib.request.urlopen(sys.argv[1] + '/healthz', timeout=10).status)\n"
        "try:\n"
        "    urllib.request.urlopen(urllib.request.Request(sys.argv[1] + '/v1/wake', data=b'{}'), timeout=10)\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code)\n"
    )
    exec_probe = ("exec", "-n", NAMESPACE, router["metadata"]["name"], "--", "python", "-c", probe, url)

    refused: list[str] = []

    def answered() -> str | None:
        # Refused until kube-proxy has programmed the Service's endpoints, which trails the
        # autoscaler's Deployment turning Available (a CI run here was refused right after).
        result = kubectl.run(*exec_probe)
        if result.returncode == 0:
            return result.stdout
        refused[:] = [result.stderr[-2000:]]
        return None

    try:
        out = wait_for(answered, 60, "the autoscaler's Service from the router's pod")
    except AssertionError as e:
        raise AssertionError(f"{e}; the probe's last error: {refused}") from None
    health, wake = out.split()
    assert health == "200" and wake in ("401", "403"), out
