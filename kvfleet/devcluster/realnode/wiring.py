"""How the control plane's command lines change when a real node runs beside it, pure: it runs
inside the node's namespace, so the API server listens on every address there and advertises the
node's (pods reach it through the ``kubernetes`` Service), authorizes kubelets as nodes, and
reaches the kubelet with a client certificate."""

from __future__ import annotations

from ..pki import Pki
from .settings import NodeSettings

# Control-plane ports the host reaches through the forwarder (kubectl, helm, readiness checks).
FORWARDED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    kept = [a for a in argv if not a.startswith(f"{flag}=")]
    return [*kept, f"{flag}={value}"]


def with_real_node(argv: dict[str, list[str]], node: NodeSettings, pki: Pki) -> dict[str, list[str]]:
    api = argv["kube-apiserver"]
    # Inside the namespace: its loopback (the forwarder's target) and the node address (pods).
    api = _set(api, "--bind-address", "0.0.0.0")
    api = _set(api, "--advertise-address", node.node_ip)
    # Node authorizes each kubelet for its own node's objects; RBAC for everyone else.
    api = _set(api, "--authorization-mode", "Node,RBAC")
    # logs, exec and port-forward: the API server calls the kubelet as a cluster admin.
    api = _set(api, "--kubelet-client-certificate", str(pki.admin_cert))
    api = _set(api, "--kubelet-client-key", str(pki.admin_key))
    api = _set(api, "--kubelet-preferred-address-types", "InternalIP")
    return {**argv, "kube-apiserver": api}
