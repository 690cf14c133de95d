"""A real node beside the real control plane for the ``node``-marked tests: kubelet, kube-proxy
(tools/node/build.sh), containerd, runc and the CNI plugins (Debian, scripts/bootstrap
--with-node), inside a network and mount namespace the cluster makes. Pods really run.

Outside CI a test skips with the reason when the binaries or Debian packages are missing; under
CI (``CI=true``) that fails.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.real_cluster import Kubectl
from support.real_node import RealNodeCluster, dev_cluster, host_facts

from kvfleet.devcluster.binaries import ensure_binaries
from kvfleet.devcluster.processes import ClusterState, pid_alive
from kvfleet.devcluster.realnode import cgroups
from kvfleet.devcluster.realnode.binaries import ensure_node_binaries, missing_system_tools
from kvfleet.devcluster.realnode.lifecycle import processes_in_netns
from kvfleet.devcluster.realnode.settings import NodeError, NodeSettings
from kvfleet.devcluster.settings import ControlPlaneError


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.node)


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
    env = {**os.environ, "KVFLEET_K8S_BIN": str(k8s_bin), "KVFLEET_NODE_BIN": str(node_bin)}
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
