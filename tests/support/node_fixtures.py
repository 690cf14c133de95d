"""The real node and what runs on it, as session fixtures shared by tests/node and tests/e2e (one
cluster per test session): kubelet, kube-proxy (tools/node/build.sh), containerd, runc and the CNI
plugins (Debian, scripts/bootstrap --with-node) inside a network and mount namespace the cluster
makes; the repository's images; a real Prometheus; the chart; a model in a real S3 server. Pods
really run. Registered once by tests/conftest.py.

Outside CI a test skips with the reason when the binaries or Debian packages are missing; under
CI (``CI=true``) that fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pytest

from kvfleet.devcluster.binaries import ensure_binaries
from kvfleet.devcluster.processes import ClusterState, pid_alive
from kvfleet.devcluster.realnode import cgroups
from kvfleet.devcluster.realnode.binaries import ensure_coredns, ensure_node_binaries, missing_system_tools
from kvfleet.devcluster.realnode.lifecycle import processes_in_netns
from kvfleet.devcluster.realnode.settings import NodeError, NodeSettings
from kvfleet.devcluster.settings import ControlPlaneError
from kvfleet_testkit.seaweedfs import SeaweedS3
from support.node_prometheus import NodePrometheus, node_prometheus
from support.real_cluster import Kubectl
from support.real_node import BIN, NODE_CACHE_ROOT, REPO, RealNodeCluster, dev_cluster, helm, host_facts, into_node

BUCKET = "node-models"
SECRET = "s3-credentials"  # the S3 credentials' Secret, in each namespace that pulls the model


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the real node cannot start under CI: {reason}")
    pytest.skip(f"no real node here: {reason}")


@pytest.fixture(scope="session")
def node_binaries() -> tuple[Path, Path]:
    """(control-plane bin folder, node bin folder)."""
    if os.geteuid() != 0:
        _unavailable("a real node needs root (namespaces, mounts, cgroups)")
    if gone := missing_system_tools(NodeSettings.cni_bin_dir):
        _unavailable(f"missing {', '.join(gone)} (scripts/bootstrap --with-node)")
    if shutil.which("buildah") is None:
        _unavailable("no buildah (scripts/bootstrap --with-node): images are built with it")
    try:
        return ensure_binaries(quiet=True), ensure_node_binaries(quiet=True)
    except (ControlPlaneError, NodeError) as e:
        _unavailable(str(e))
        raise


@pytest.fixture(scope="session")
def real_node(node_binaries: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    """`kvfleet dev cluster up --real-node` (the command people run), once per session; at the end
    `down`, and the teardown fails the run when anything is left: a process, a cgroup, a process in
    the node's namespace, a changed host sysctl or iptables rule."""
    k8s_bin, node_bin = node_binaries
    try:
        coredns = ensure_coredns(quiet=True)
    except NodeError as e:
        _unavailable(str(e))
        raise
    env = {
        **os.environ,
        "KVFLEET_K8S_BIN": str(k8s_bin),
        "KVFLEET_NODE_BIN": str(node_bin),
        "KVFLEET_COREDNS_BIN": str(coredns.parent),
    }
    root = tmp_path_factory.mktemp("real-node") / "dev"
    before = host_facts()
    t0 = time.monotonic()
    up = dev_cluster("up", "--dir", str(root), "--gpu-nodes", "1", "--real-node", env=env)
    started_s = time.monotonic() - t0
    state = ClusterState.load(root)
    try:
        if up.returncode != 0 or state is None:
            _unavailable(f"`kvfleet dev cluster up --real-node` failed: {up.stderr[-3000:]}")
        assert state is not None
        yield RealNodeCluster(root, state, Kubectl(root / "kubeconfig"), env, started_s)
    finally:
        down = dev_cluster("down", "--dir", str(root), env=env)
    assert down.returncode == 0, down.stderr
    assert state is not None and state.node is not None
    assert not [n for n, pid in state.pids.items() if pid_alive(pid)], "a process of the cluster still runs"
    assert not processes_in_netns(state.node["netns"]), "a process still runs in the node's namespace"
    assert not [h for h in cgroups.hierarchies() if (h / f"kvfleet-{state.node['cluster_id']}").exists()]
    assert host_facts() == before, "the host's sysctls, iptables rules or /var/lib changed"
    assert not root.exists()


CHART = REPO / "charts" / "kvfleet"
NAMESPACE = "kvfleet-system"
COMPONENTS = ("operator", "router", "autoscaler")
# Where the registry's torch comes from for the engine image (PyTorch's CPU index is unreachable).
TORCH_INDEX = os.environ.get("KVFLEET_TORCH_INDEX", "https://pypi.org/simple")


def _built_images(real_node: RealNodeCluster, *flags: str) -> dict[str, str]:
    t0 = time.monotonic()
    out = dev_cluster("images", "--dir", str(real_node.root), *flags, env=real_node.env, timeout_s=2400)
    assert out.returncode == 0, out.stderr[-3000:]
    found = {}
    for line in out.stdout.splitlines():
        if line.startswith("kvfleet.local/"):
            print(line)
            ref = line.split(":", 2)
            found[ref[0].removeprefix("kvfleet.local/")] = f"{ref[0]}:{ref[1]}"
    print(f"images ready in {time.monotonic() - t0:.0f} s with the command")
    return found


@pytest.fixture(scope="session")
def control_plane_image(real_node: RealNodeCluster) -> str:
    """The control-plane image from `Dockerfile`, by `kvfleet dev cluster images` (built once,
    cached by its inputs, and loaded into the node)."""
    return _built_images(real_node, "--no-engine")["kvfleet"]


@pytest.fixture(scope="session")
def engine_image(real_node: RealNodeCluster, control_plane_image: str) -> str:
    """The CPU engine image from `engine_image/Dockerfile.cpu` (the registry's torch), cached by
    its inputs and kept in the node's containerd store across runs."""
    return _built_images(real_node, "--torch-index", TORCH_INDEX)["engine-cpu"]


@pytest.fixture(scope="session")
def prometheus(real_node: RealNodeCluster) -> Iterator[NodePrometheus]:
    """A real Prometheus in the node's namespace, where the chart's autoscaler reads it
    (support/node_prometheus.py); up before the chart, so the autoscaler never starts blind."""
    with node_prometheus(real_node, real_node.root / "prometheus") as running:
        yield running


@pytest.fixture(scope="session")
def chart(real_node: RealNodeCluster, control_plane_image: str, prometheus: NodePrometheus) -> str:
    """`helm install` of the chart with the image built here, once per session: the operator, the
    routers and the autoscaler on the real node, Ready. The policy allows the node cache's root and
    the locally built engine image. Returns the release namespace."""
    repository, tag = control_plane_image.rsplit(":", 1)
    cache_root = real_node.node_path(NODE_CACHE_ROOT)
    # As docs/operator.md asks of a node cache's root: setgid, writable by the engines' group.
    cache_root.mkdir(parents=True, exist_ok=True)
    os.chown(cache_root, 0, 1000)
    cache_root.chmod(0o2775)
    values = {
        "image.repository": repository,
        "image.tag": tag,
        "image.pullPolicy": "Never",
        "policy.nodeCacheHostPaths": "{" + NODE_CACHE_ROOT + "}",
        "policy.imageRegistries": "{ghcr.io/kvfleet,kvfleet.local}",
    }
    helm(
        real_node,
        Path(real_node.env["KVFLEET_K8S_BIN"]) / "helm",
        *("install", "kvfleet", str(CHART), "-n", NAMESPACE, "--create-namespace"),
        *("-f", str(CHART / "ci" / "no-monitoring-values.yaml")),
        *[a for k, v in values.items() for a in ("--set", f"{k}={v}")],
    )
    for component in COMPONENTS:
        real_node.kubectl(
            *("rollout", "status", "-n", NAMESPACE, f"deployment/kvfleet-{component}", "--timeout=240s"),
            timeout_s=250,
        )
    return NAMESPACE


@dataclass(frozen=True)
class S3Model:
    endpoint_in_node: str  # where pods reach the S3 server
    uri: str
    total_bytes: int
    smallest_shard: int
    server: SeaweedS3


def bucket_bytes_sent(server: SeaweedS3) -> float:
    """SeaweedFS's own count of the bytes its S3 gateway sent for the bucket."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    pattern = rf'^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{{[^}}]*bucket="{BUCKET}"[^}}]*\}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


@pytest.fixture(scope="session")
def s3_model(
    real_node: RealNodeCluster, seaweedfs: SeaweedS3, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Model]:
    model = tmp_path_factory.mktemp("model") / "tiny"
    env = {**real_node.env, **seaweedfs.env()}
    subprocess.run([str(BIN / "kvfleet"), "engine", "make-tiny-model", str(model)], check=True, env=env, timeout=300)
    boto3.client(
        "s3",
        endpoint_url=seaweedfs.endpoint_url,
        aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key,
        region_name=seaweedfs.region,
    ).create_bucket(Bucket=BUCKET)
    uri = f"s3://{BUCKET}/tiny"
    subprocess.run(
        [str(BIN / "kvfleet"), "cache", "populate", str(model), uri, "--quiet"], check=True, env=env, timeout=300
    )
    shards = [f.stat().st_size for f in model.iterdir() if f.suffix == ".safetensors"]
    total = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    port = urlparse(seaweedfs.endpoint_url).port
    assert port is not None
    with into_node(real_node, port) as endpoint:
        yield S3Model(endpoint, uri, total, min(shards), seaweedfs)


def s3_credentials(cluster: RealNodeCluster, model: S3Model, namespace: str) -> None:
    """The Secret engine pods in ``namespace`` read the S3 server's credentials from."""
    cluster.kubectl(
        *("create", "secret", "generic", SECRET, "-n", namespace),
        f"--from-literal=AWS_ACCESS_KEY_ID={model.server.access_key}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={model.server.secret_key}",
    )


@pytest.fixture(scope="session")
def engine_ready(real_node: RealNodeCluster, chart: str, engine_image: str, s3_model: S3Model) -> S3Model:
    """The chart, the engine image and the model in S3 with its credentials in `default`."""
    s3_credentials(real_node, s3_model, "default")
    return s3_model
