"""Each component's command line, pure: the flags that make etcd, kube-apiserver (client
certificates, service-account tokens, RBAC, an audit log), kube-controller-manager, kube-scheduler
and kwok one local cluster, the way controller-runtime's envtest runs one. Tests and
``kvfleet dev cluster up --dry-run`` read them without starting anything."""

from __future__ import annotations

import os
from pathlib import Path

from .nodes import NODE_SELECTOR_ANNOTATION
from .pki import Pki
from .settings import ClusterSettings, ControlPlaneError

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_NODE_LEASE_S = 40
"""Each kwok node's Lease duration (a kubelet's default): kwok renews it every quarter of this."""
AUDIT_POLICY: dict[str, object] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    # Metadata is enough to see who did what to which resource, and what the server answered.
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}


def audit_policy(user_groups: tuple[str, ...]) -> dict[str, object]:
    """``AUDIT_POLICY``, or one that records only requests of ``user_groups`` (the rest: level None)."""
    if not user_groups:
        return AUDIT_POLICY
    return {**AUDIT_POLICY, "rules": [{"level": "Metadata", "userGroups": list(user_groups)}, {"level": "None"}]}


def first_service_ip(cidr: str) -> str:
    import ipaddress

    return str(next(ipaddress.ip_network(cidr).hosts()))


def _binary(settings: ClusterSettings, name: str) -> str:
    path = settings.bin_dir / name
    if not os.access(path, os.X_OK):
        raise ControlPlaneError(f"{name} not found at {path}: build it with tools/k8s/build.sh")
    return str(path)


def client_rate(settings: ClusterSettings) -> list[str]:
    """The controller-manager's and scheduler's client rate flags (none: Kubernetes' defaults)."""
    qps = settings.controllers_api_qps
    return [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"] if qps > 0 else []


def kwok_configuration(settings: ClusterSettings) -> dict[str, object]:
    """kwok's own settings (a second ``--config`` beside its stages)."""
    return {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokConfiguration",
        # A given configuration is not defaulted: the other parallelisms are kwok's defaults.
        "options": {
            "podPlayStageParallelism": settings.kwok_pod_parallelism,
            "nodePlayStageParallelism": 4,
            "nodeLeaseParallelism": 4,
            "podsOnNodeSyncParallelism": 1,
        },
    }


def component_argv(
    settings: ClusterSettings, pki: Pki, ports: dict[str, int], kubeconfig: Path
) -> dict[str, list[str]]:
    """Every component's command line (pure: tests and ``--dry-run`` read it)."""
    root = settings.root
    kc = str(kubeconfig)
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    return {
        "etcd": [
            _binary(settings, "etcd"),
            f"--data-dir={root / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-cluster=default=http://127.0.0.1:{ports['etcd-peer']}",
            "--name=default",
            # A throw-away store: durability costs fsyncs that make a test run slower, nothing else.
            "--unsafe-no-fsync",
            "--quota-backend-bytes=2147483648",
            "--log-level=warn",
        ],
        "kube-apiserver": [
            _binary(settings, "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--secure-port={ports['kube-apiserver']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--cert-dir={root / 'pki'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={settings.service_cidr}",
            "--authorization-mode=RBAC",
            # As hardened clusters do: setting blockOwnerDeletion needs update on the owner's
            # finalizers, so the operator's RBAC is checked for it.
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            "--allow-privileged=true",
            f"--audit-policy-file={root / 'audit-policy.yaml'}",
            f"--audit-log-path={root / 'logs' / 'audit.log'}",
            f"--audit-log-maxsize={settings.audit_log_max_mb}",
            "--audit-log-maxbackup=1",
            "--audit-log-mode=blocking",  # an entry is on disk before the answer: tests read it at once
        ],
        "kube-controller-manager": [
            _binary(settings, "kube-controller-manager"),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            f"--secure-port={ports['kube-controller-manager']}",
            "--bind-address=127.0.0.1",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}",
            f"--cluster-signing-key-file={pki.ca_key}",
            # kwok nodes have no kubelet: pods are the only thing to garbage-collect, and fast.
            # kwok renews node leases from one process: on a busy machine a renewal can be late by
            # tens of seconds, and the default 50 s grace then marks every node (and pod) NotReady.
            "--node-monitor-grace-period=5m",
            "--concurrent-deployment-syncs=10",
            "--concurrent-replicaset-syncs=10",
            *client_rate(settings),
        ],
        "kube-scheduler": [
            _binary(settings, "kube-scheduler"),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            f"--secure-port={ports['kube-scheduler']}",
            "--bind-address=127.0.0.1",
            *client_rate(settings),  # deprecated flags, still read when no --config is given
        ],
        "kwok": [
            _binary(settings, "kwok"),
            f"--kubeconfig={kc}",
            f"--config={settings.bin_dir.parent / 'kwok-stages.yaml'}",
            f"--config={root / 'kwok-config.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={NODE_SELECTOR_ANNOTATION}=fake",
            f"--cidr={settings.pod_cidr}",
            # kwok renews each node's Lease (kube-node-lease) itself: its node-heartbeat-with-lease
            # stage writes node status only every 10-20 min, so without the Leases every node (and
            # every pod on it) turned NotReady at the controller-manager's grace, 5 min in, and the
            # pods never turned Ready again (kwok's pod stage had run).
            f"--node-lease-duration-seconds={KWOK_NODE_LEASE_S}",
            "--node-ip=127.0.0.1",
            f"--node-port={ports['kwok-node']}",
            f"--server-address=127.0.0.1:{ports['kwok']}",
        ],
    }
