"""`kvfleet dev cluster up|status|down`: the command people use, end to end (its own second cluster)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from support.real_cluster import BIN, Kubectl, wait_for

from kvfleet.devcluster.controlplane import ClusterState, ControlPlane
from kvfleet.devcluster.processes import pid_alive


def kvfleet(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "kvfleet"), "dev", "cluster", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_up_prints_the_kubeconfig_and_down_removes_everything(control_plane: ControlPlane, tmp_path: Path) -> None:
    root = tmp_path / "dev"
    env = {**os.environ, "KVFLEET_K8S_BIN": str(control_plane.settings.bin_dir)}
    up = kvfleet("up", "--dir", str(root), "--gpu-nodes", "2", "--gpu-product", "NVIDIA-A100-SXM4-80GB", env=env)
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = root / "kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout
        assert "kvfleet dev cluster down" in up.stdout
        nodes = Kubectl(kubeconfig).json("get", "nodes")["items"]
        assert [n["metadata"]["labels"]["nvidia.com/gpu.product"] for n in nodes] == ["NVIDIA-A100-SXM4-80GB"] * 2
        assert all(n["status"]["allocatable"]["nvidia.com/gpu"] == "8" for n in nodes)
        version = json.loads(Kubectl(kubeconfig)("version", "-o", "json"))["serverVersion"]["gitVersion"]
        assert version.startswith("v1.36.")
        status = kvfleet("status", "--dir", str(root), env=env)
        assert status.returncode == 0 and "STOPPED" not in status.stdout, status.stdout
        again = kvfleet("up", "--dir", str(root), env=env)
        assert again.returncode != 0 and "already running" in again.stderr
    finally:
        state = ClusterState.load(root)
        down = kvfleet("down", "--dir", str(root), env=env)
    assert down.returncode == 0, down.stderr
    assert state is not None and not any(pid_alive(pid) for pid in state.pids.values())
    assert not root.exists()
    assert kvfleet("status", "--dir", str(root), env=env).returncode == 1


def test_kwok_renews_a_lease_for_every_node(kubectl: Kubectl) -> None:
    # Without the Leases, kwok's nodes (and their pods) turned NotReady at the node monitor's grace,
    # 5 minutes in, and stayed so for its pods: every run longer than that measured nothing real.
    nodes = {n["metadata"]["name"] for n in kubectl.json("get", "nodes")["items"]}
    first = {item["metadata"]["name"]: item for item in kubectl.json("get", "leases", "-n", "kube-node-lease")["items"]}
    assert nodes and nodes <= set(first), sorted(nodes - set(first))

    def renewed() -> bool:
        now = {i["metadata"]["name"]: i for i in kubectl.json("get", "leases", "-n", "kube-node-lease")["items"]}
        return all(now[n]["spec"]["renewTime"] != first[n]["spec"]["renewTime"] for n in nodes)

    wait_for(renewed, 60, "every node's Lease renewed")
