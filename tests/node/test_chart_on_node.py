"""The chart on the real node with the image built from the repository's own Dockerfile (buildah,
a Debian base from mmdebstrap; no registry): the operator, router and autoscaler pods really run,
go Ready through their probes, log no error, and the router answers through its Service from the
host's loopback (the address `up --real-node` prints)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from support.real_cluster import wait_for
from support.real_node import RealNodeCluster, dev_cluster, helm

from kvfleet.devcluster.realnode.settings import NODE_NAME

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
NAMESPACE = "kvfleet-system"
COMPONENTS = ("operator", "router", "autoscaler")
ERROR_MARKS = ("Traceback", " ERROR ", "level=error", "CRITICAL")


@pytest.fixture(scope="module")
def control_plane_image(real_node: RealNodeCluster) -> str:
    """The control-plane image from `Dockerfile`, by `kvfleet dev cluster images` (built once,
    cached by its inputs, and loaded into the node)."""
    t0 = time.monotonic()
    out = dev_cluster("images", "--dir", str(real_node.root), "--no-engine", env=real_node.env, timeout_s=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("kvfleet.local/kvfleet:")]
    print(f"{line} ({time.monotonic() - t0:.0f} s with the command)")
    name = line.split(":", 2)
    return f"{name[0]}:{name[1]}"


def test_helm_install_runs_the_control_plane_pods(real_node: RealNodeCluster, control_plane_image: str) -> None:
    kubectl = real_node.kubectl
    repository, tag = control_plane_image.rsplit(":", 1)
    helm_binary = Path(real_node.env["KVFLEET_K8S_BIN"]) / "helm"
    values = ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never"]
    helm(
        real_node,
        helm_binary,
        *("install", "kvfleet", str(CHART), "-n", NAMESPACE, "--create-namespace"),
        *("-f", str(CHART / "ci" / "no-monitoring-values.yaml"), *values),
    )
    for component in COMPONENTS:
        kubectl(
            *("rollout", "status", "-n", NAMESPACE, f"deployment/kvfleet-{component}", "--timeout=240s"),
            timeout_s=250,
        )
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
