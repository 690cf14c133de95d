"""The chart on the real node with the image built from the repository's own Dockerfile (buildah,
a Debian base from mmdebstrap; no registry): the operator, router and autoscaler pods really run,
go Ready through their probes, log no error, and the router answers through its Service from the
host's loopback (the address `up --real-node` prints)."""

from __future__ import annotations

import json
import urllib.request

from support.real_cluster import wait_for
from support.real_node import RealNodeCluster

from kvfleet.devcluster.realnode.settings import NODE_NAME

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
