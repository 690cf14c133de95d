"""The local cluster's settings (where its files and binaries are, its fake GPU nodes, its
address ranges, its bounds), its components in start order, and the one error every step raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Components in start order; ``stop`` goes in reverse so nothing loses the API under it.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class ControlPlaneError(RuntimeError):
    """A component would not start or become ready; the message names it and its log file."""


@dataclass(frozen=True)
class ClusterSettings:
    root: Path  # every file of the cluster (certificates, etcd data, logs); ``down`` removes it
    bin_dir: Path  # kube-apiserver, kube-controller-manager, kube-scheduler, etcd, kwok
    gpu_nodes: int = 3  # kwok nodes; enough for a 3-replica deployment spread over nodes
    gpus_per_node: int = 8  # nvidia.com/gpu capacity of each (an 8-GPU H100 node)
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"  # the nvidia.com/gpu.product label GPU Operator sets
    service_cidr: str = "10.96.0.0/16"  # ClusterIPs; its first address is the kubernetes Service
    pod_cidr: str = "10.244.0.0/16"  # kwok gives pods addresses from here
    ready_timeout_s: float = 120.0  # per component; a cold etcd + API server is ready in ~10 s here
    # Client-side rate limit of the controller-manager and the scheduler (requests/s; burst twice
    # that). Kubernetes' defaults (20 and 50/s) are sized for a shared production API server: here
    # they, not the kwok nodes, set the pace of a large rollout (a 3-pod Deployment costs the
    # controllers ~10 requests: 1,000 of them ~500 s at 20/s), for plain Deployments and kvfleet's
    # engine Deployments alike. 0 keeps the defaults.
    controllers_api_qps: int = 200
    # Pod stages (Ready, delete) kwok plays at once for all its nodes; kwok's default is 4. Real
    # nodes each run their own kubelet: 4 for 250 nodes made kwok the floor of a large rollout
    # (at 1,000 Deployments, pods deleted by a rolling update stayed Terminating, holding their
    # GPUs, while the new pods waited Pending for them).
    kwok_pod_parallelism: int = 32
    audit_log_max_mb: int = 200  # rotated past this; tests read the audit log of their own run
    # A real node beside the kwok ones (kvfleet.devcluster.realnode): its binaries' folder
    # (tools/node/build.sh), or None for kwok nodes only.
    node_bin_dir: Path | None = None
    # The real node's cluster DNS binary (tools/coredns/build.sh); None: no cluster DNS.
    coredns: Path | None = None
    # The Service the host's loopback port ``router`` forwards to (NAMESPACE/NAME:PORT): the
    # chart's router as `helm install kvfleet charts/kvfleet -n kvfleet-system` names it.
    router_service: str = "kvfleet-system/kvfleet-router:80"
    # Audit only these user groups (e.g. "system:serviceaccounts:kvfleet-system"); empty: everyone.
    # A benchmark with thousands of pods would otherwise rotate away its own entries.
    audit_user_groups: tuple[str, ...] = ()
