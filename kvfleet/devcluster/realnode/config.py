"""The real node's files and command lines, pure: containerd's config, the CNI network, the
kubelet's and kube-proxy's configurations, and what the namespace holder mounts. Each setting
that differs from upstream's defaults says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .settings import (
    CLUSTER_DOMAIN,
    DNS_HEALTH_PORT,
    DNS_PORT,
    DNS_READY_PORT,
    DNS_USER,
    KUBELET_PORT,
    NODE_LABEL,
    NODE_NAME,
    PAUSE_IMAGE,
    NodeSettings,
)

# The global sysctls the kubelet sets when they differ (pkg/kubelet/cm's kernel tunables). The
# namespace holder bind-mounts a file with each wanted value over its /proc/sys entry, so the
# kubelet finds them set and the host's values never change.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# Folders containerd, runc, the CNI plugins and the kubelet write at fixed paths: inside the
# namespace each is the node's own folder.
PRIVATE_DIRS = ("/var/lib", "/var/log", "/run")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are valid TOML escapes


def _toml(table: dict[str, Any], prefix: str = "") -> list[str]:
    lines = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for key, value in table.items():
        if isinstance(value, dict):
            name = f"{prefix}.{key}" if prefix else key
            lines += ["", f"[{name}]", *_toml(value, name)]
    return lines


def containerd_config(s: NodeSettings, root: Path | None = None) -> str:
    """containerd 1.6's config (version 2), every path the node's own; ``root`` (its content and
    snapshots) may be a store kept across clusters (``images.node_store``)."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    doc = {
        "version": 2,
        "root": str(root or s.root / "containerd" / "root"),
        "state": str(s.root / "containerd" / "state"),
        "grpc": {"address": str(s.containerd_socket)},
        "ttrpc": {"address": str(s.containerd_socket) + ".ttrpc"},
        cri: {
            "sandbox_image": PAUSE_IMAGE,
            # Without it every pod fails ("can't get final child's PID from pipe: EOF"): the
            # machine's sandbox lacks CAP_SYS_RESOURCE, so runc may not lower oom_score_adj.
            "restrict_oom_score_adj": True,
            "netns_mounts_under_state_dir": True,
            "containerd": {
                "snapshotter": "overlayfs",
                "default_runtime_name": "runc",
                "runtimes": {
                    "runc": {
                        "runtime_type": "io.containerd.runc.v2",
                        # The kubelet's cgroup driver (no systemd here).
                        "options": {"SystemdCgroup": False},
                    }
                },
            },
            "cni": {"bin_dir": str(s.cni_bin_dir), "conf_dir": str(s.root / "cni" / "net.d")},
        },
        'plugins."io.containerd.internal.v1.opt"': {"path": str(s.root / "containerd" / "opt")},
    }
    # Top-level keys first, then the tables (TOML's order); the quoted plugin names are one key.
    top = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    lines = _toml(top)
    for key, value in doc.items():
        if isinstance(value, dict):
            lines += ["", f"[{key}]", *_toml(value, key)]
    return "\n".join(lines) + "\n"


def cni_network(s: NodeSettings) -> dict[str, Any]:
    """One bridge with host-local addresses from the node's pod range; hairpin so a pod reaches
    itself through its own Service."""
    return {
        "cniVersion": "1.0.0",
        "name": "kvfleet",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": s.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(s.root / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(s: NodeSettings, ca_file: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{s.containerd_socket}",
        # No systemd here, and this machine mounts cgroup v1 (the kubelet refuses v1 unless told).
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "cgroupRoot": s.cgroup_root,  # its own: teardown removes exactly what it made
        "failSwapOn": False,
        # Its iptables chains would go into the namespace anyway; kube-proxy owns the rules.
        "makeIPTablesUtilChains": False,
        "protectKernelDefaults": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "resolvConf": "",  # no host DNS inside pods: nothing outside the namespace is reachable
        "clusterDomain": CLUSTER_DOMAIN,
        # Every pod's resolv.conf names the node's CoreDNS (none without one: names never resolve).
        "clusterDNS": [s.node_ip] if s.coredns is not None else [],
        "maxPods": s.max_pods,
        "serializeImagePulls": False,
        # A shared machine's disk and memory sit well below upstream's thresholds' comfort: evict
        # only when truly out, never because another process filled the disk for a while.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        # No image garbage collection: the node's images are imported by `kvfleet dev cluster images`
        # (never pulled, nothing to pull them from), and on a disk the node shares with the host a
        # build elsewhere filled it past 99% for a while: the kubelet then removed every image no
        # container used, the imported pause image among them (containerd 1.6 does not pin an
        # imported sandbox image), and no pod could start until the next import. 100 disables it.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "staticPodPath": "",
    }


def kube_proxy_config(s: NodeSettings, kubeconfig: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": s.pod_cidr,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Source-NAT every Service connection: a reply from a pod on the same bridge then goes back
        # through the node and is un-NATed even where bridged traffic skips iptables.
        "iptables": {"masqueradeAll": True},
        # 0 leaves the conntrack table's size and timeouts alone: they are the host's, not ours.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def corefile(s: NodeSettings, kubeconfig: Path) -> str:
    """CoreDNS's configuration: the cluster's Services and pods from the API server, nothing else
    (no upstream: nothing outside the namespace is reachable). Short TTLs: a dev cluster's
    Services come and go between tests."""
    return f"""\
.:{DNS_PORT} {{
    bind {s.node_ip}
    errors
    health 127.0.0.1:{DNS_HEALTH_PORT}
    ready 127.0.0.1:{DNS_READY_PORT}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""


def coredns_rbac() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): what the cluster DNS may read (upstream CoreDNS's rules)."""
    name, read = "kvfleet:coredns", ["list", "watch"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": read},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DNS_USER}],
    }
    base = "/apis/rbac.authorization.k8s.io/v1"
    return [(f"{base}/clusterroles", role), (f"{base}/clusterrolebindings", binding)]


def node_argv(s: NodeSettings, files: dict[str, Path]) -> dict[str, list[str]]:
    """Each node component's command line (run inside the namespace)."""
    dns = {} if s.coredns is None else {"coredns": [str(s.coredns), "-conf", str(files["corefile"])]}
    return {
        **dns,
        "containerd": ["containerd", f"--config={files['containerd']}"],
        "kubelet": [
            str(s.bin_dir / "kubelet"),
            f"--config={files['kubelet']}",
            f"--kubeconfig={files['kubelet-kubeconfig']}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={s.node_ip}",
            f"--node-labels={NODE_LABEL}=true",
            f"--root-dir={s.root / 'kubelet'}",
            f"--cert-dir={s.root / 'kubelet' / 'pki'}",
            "--v=1",
        ],
        "kube-proxy": [str(s.bin_dir / "kube-proxy"), f"--config={files['kube-proxy']}", "--v=1"],
    }


def holder_plan(s: NodeSettings) -> dict[str, Any]:
    """What the namespace holder sets up before anything runs in it."""
    return {
        "sysctls": {f"/proc/sys/{k}": v for k, v in KUBELET_SYSCTLS.items()},
        "private_dirs": {d: str(s.root / "private" / d.strip("/").replace("/", "-")) for d in PRIVATE_DIRS},
        "node_ip": s.node_ip,
        "ready_file": str(s.root / "namespace.ready"),
    }
