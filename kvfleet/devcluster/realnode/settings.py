"""What the real node is: its name and address inside its namespace, its pod range, its cgroup
root and the bounds of its start-up."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

NODE_NAME = "kvfleet-node"
NODE_LABEL = "kvfleet.io/real-node"  # set on the real node; kwok nodes never carry it
# kwok's fake nodes get this taint when a real node runs beside them, so only pods that ask for a
# fake node land there (a chart pod on a kwok node would "run" without a process).
KWOK_TAINT = {"key": "kvfleet.io/kwok", "value": "fake", "effect": "NoSchedule"}
PAUSE_IMAGE = "kvfleet.local/pause:1"  # the pod sandbox image, built from tools/node/pause
KUBELET_PORT = 10250  # inside the node's own network namespace: no other process can hold it
CLUSTER_DOMAIN = "cluster.local"
# The cluster DNS (CoreDNS, tools/coredns) answers on the node address's port 53, where the
# kubelet points every pod's resolv.conf (as NodeLocal DNSCache does with its node-local address);
# its health and readiness ports listen on the namespace's loopback only.
DNS_PORT = 53
DNS_HEALTH_PORT = 10280
DNS_READY_PORT = 10281
DNS_USER = "system:kvfleet-coredns"  # its client certificate's user, bound to read-only RBAC


class NodeError(RuntimeError):
    """The real node would not start or stop cleanly; the message says which part and why."""


@dataclass(frozen=True)
class NodeSettings:
    root: Path  # the node's files (containerd's store, kubelet's root, logs); removed at ``down``
    bin_dir: Path  # kubelet, kube-proxy, crictl, pause (tools/node/build.sh)
    cluster_id: str  # names the cgroup root, so two clusters on one machine never share one
    node_ip: str = "10.99.0.1"  # on the namespace's loopback; the API server advertises it too
    pod_cidr: str = "10.88.0.0/24"  # the bridge's range; apart from kwok's pod range
    cni_bin_dir: Path = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
    ready_timeout_s: float = 90.0  # node Ready in ~4 s here; a cold containerd store takes longer
    stop_timeout_s: float = 20.0  # per step of the teardown before SIGKILL
    max_pods: int = 30  # a laptop-sized node: bounds what one test run can start
    # The cluster DNS's binary (tools/coredns/build.sh); None: pods resolve no Service names.
    coredns: Path | None = None

    def __post_init__(self) -> None:
        ipaddress.ip_address(self.node_ip)
        ipaddress.ip_network(self.pod_cidr)
        if not self.cluster_id.replace("-", "").isalnum() or len(self.cluster_id) > 32:
            raise NodeError(f"cluster_id must be 1-32 letters, digits or '-', got {self.cluster_id!r}")
        hidden = [d for d in ("/var/lib", "/var/log", "/run") if self.root.is_relative_to(d)]
        if hidden:
            # Inside the namespace those folders are the node's own, so its files there would vanish.
            raise NodeError(f"root {self.root} must not be under {hidden[0]} (the node mounts its own there)")

    @property
    def cgroup_root(self) -> str:
        return f"/kvfleet-{self.cluster_id}"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd" / "containerd.sock"
