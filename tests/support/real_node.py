"""Helpers for the tests on the real node (tests/node): the cluster a session runs, the `kvfleet dev
cluster` command, and the host facts a node must leave unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvfleet.devcluster.processes import ClusterState
from kvfleet_testkit.processes import stop_process
from support.real_cluster import Kubectl

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
# The node cache's root inside the node (its /var/lib is the node's own folder, never the host's),
# allowed by the chart's policy; engine pods get <root>/<namespace> below it.
NODE_CACHE_ROOT = "/var/lib/kvfleet/models"


@dataclass(frozen=True)
class RealNodeCluster:
    root: Path
    state: ClusterState
    kubectl: Kubectl
    env: dict[str, str]
    started_s: float

    @property
    def node(self) -> dict[str, str]:
        assert self.state.node is not None
        return self.state.node

    def node_path(self, inside: str) -> Path:
        """Where a path of the node's own /var/lib is on the host."""
        return Path(self.node["root"]) / "private" / "var-lib" / inside.removeprefix("/var/lib/")

    @property
    def socket(self) -> Path:
        return Path(self.node["root"]) / "containerd" / "containerd.sock"


def host_facts() -> dict[str, str]:
    """What the node must leave as it found it: the global sysctls the kubelet wants, the host's
    iptables rules and /var/lib's entries."""
    facts = {k: Path(f"/proc/sys/{k}").read_text() for k in HOST_SYSCTLS}
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=False).stdout
    facts["iptables"] = "\n".join(line for line in rules.splitlines() if not line.startswith("#"))
    facts["var-lib"] = str(sorted(os.listdir("/var/lib")))
    return facts


HOST_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "vm/panic_on_oom")


def dev_cluster(*args: str, env: dict[str, str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "kvfleet"), "dev", "cluster", *args], capture_output=True, text=True, timeout=timeout_s, env=env
    )


def helm(cluster: RealNodeCluster, helm_binary: Path, *args: str, timeout_s: float = 300) -> str:
    home = cluster.root / "helm-home"
    env = {**cluster.env, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
    result = subprocess.run(
        [str(helm_binary), "--kubeconfig", str(cluster.root / "kubeconfig"), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}\n{result.stdout[-2000:]}"
    return result.stdout


@contextmanager
def into_node(cluster: RealNodeCluster, host_port: int, node_port: int | None = None) -> Iterator[str]:
    """A server on the host's loopback (``127.0.0.1:host_port``) reachable from pods at the node
    address (the forwarder's ``--into``), as a datacenter's S3 would be; yields the URL pods use.
    Stopped by its PID."""
    from kvfleet.devcluster.realnode.settings import NodeSettings

    port = node_port or host_port
    holder = cluster.state.pids["netns"]
    argv = [
        sys.executable,
        "-m",
        "kvfleet.devcluster.realnode.forward",
        f"--netns=/proc/{holder}/ns/net",
        "--into",
        f"{NodeSettings.node_ip}:{port}=127.0.0.1:{host_port}",
    ]
    log = (cluster.root / "logs" / f"into-{port}.log").open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield f"http://{NodeSettings.node_ip}:{port}"
    finally:
        stop_process(proc, grace_s=10)
        log.close()
