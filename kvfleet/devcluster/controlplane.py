"""A real Kubernetes control plane as local processes: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, and kwok nodes with fake GPUs. The way controller-runtime's envtest runs one, plus
the controllers and the fake kubelets that make Deployments produce scheduled, Ready pods with IPs.

``start`` brings everything up and waits until the API is ready, the controllers run and every
GPU node is Ready; ``stop`` ends every process it started. State (ports, PIDs) is written to
``<root>/state.json`` so ``kvfleet dev cluster down`` can stop a cluster another process started.

This module is the start-up sequence; what it runs lives beside it: ``settings`` (the settings,
the components, the error), ``commands`` (each component's command line), ``pki`` (certificates
and keys), ``admin`` (the kubeconfig and the admin's API calls), ``readiness`` (when a component
is up), ``processes`` (the state file and stopping), ``binaries`` (where the binaries come from).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from kvfleet.free_port import pick_free_port

from .admin import AdminApi, kubeconfig_document
from .commands import audit_policy, component_argv, first_service_ip, kwok_configuration
from .nodes import gpu_nodes
from .pki import Pki, make_pki
from .processes import NODE_FIRST, ClusterState, pid_alive, stop_root, terminate
from .readiness import api_ok, etcd_healthy, nodes_ready, scheduler_ok, wait_ready
from .realnode.lifecycle import RealNode
from .realnode.settings import KWOK_TAINT, NodeSettings
from .realnode.wiring import FORWARDED, with_real_node
from .settings import COMPONENTS, ClusterSettings, ControlPlaneError

log = logging.getLogger(__name__)

# Importable from here, where the tests and benchmarks that start a cluster look for them.
__all__ = [
    "COMPONENTS",
    "AdminApi",
    "ClusterSettings",
    "ClusterState",
    "ControlPlane",
    "ControlPlaneError",
    "kubeconfig_document",
    "running",
    "stop_root",
]


class ControlPlane:
    """Start and stop one local control plane. Use as a context manager, or start/stop by hand."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.state: ClusterState | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._node: RealNode | None = None
        self._enter: list[str] = []  # the nsenter prefix when the control plane runs in the node's namespace

    @property
    def kubeconfig(self) -> Path:
        return self.settings.root / "kubeconfig"

    @property
    def pki(self) -> Pki:
        folder = self.settings.root / "pki"
        return Pki(
            ca_cert=folder / "ca.crt",
            ca_key=folder / "ca.key",
            serving_cert=folder / "apiserver.crt",
            serving_key=folder / "apiserver.key",
            admin_cert=folder / "admin.crt",
            admin_key=folder / "admin.key",
            sa_key=folder / "sa.key",
            sa_pub=folder / "sa.pub",
        )

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log_path = self.settings.root / "logs" / f"{name}.log"
        with open(log_path, "ab") as out:
            # A session of its own: `kvfleet dev cluster up` returns and the cluster keeps running,
            # and a Ctrl-C in the terminal that started it does not reach it.
            self._procs[name] = subprocess.Popen(
                [*self._enter, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        log.info("started %s (pid %d), log %s", name, self._procs[name].pid, log_path)

    def _wait(self, name: str, check: Callable[[], str | None]) -> None:
        log_file = self.settings.root / "logs" / f"{name}.log"
        wait_ready(check, name, self.settings.ready_timeout_s, log_file, self._procs[name])

    def start(self) -> ClusterState:
        s = self.settings
        existing = ClusterState.load(s.root)
        if existing is not None and any(pid_alive(pid) for pid in existing.pids.values()):
            raise ControlPlaneError(f"a cluster is already running from {s.root}; stop it first (down)")
        if s.node_bin_dir is not None and (s.root / "etcd").exists():
            # A real node's pods and containers died with its last run: an old store would only
            # bring back their objects, and the `kubernetes` Service's endpoint at the old port
            # (the API server's lease reconciler was seen not to correct it).
            shutil.rmtree(s.root / "etcd")
        for sub in ("pki", "logs", "etcd"):
            (s.root / sub).mkdir(parents=True, exist_ok=True)
        node_settings = None
        if s.node_bin_dir is not None:
            node_settings = NodeSettings(
                root=s.root / "node", bin_dir=s.node_bin_dir, cluster_id=uuid.uuid4().hex[:12], coredns=s.coredns
            )
        extra_ips = (node_settings.node_ip,) if node_settings else ()
        pki = make_pki(s.root / "pki", service_ip=first_service_ip(s.service_cidr), extra_ips=extra_ips)
        (s.root / "audit-policy.yaml").write_text(yaml.safe_dump(audit_policy(s.audit_user_groups)))
        (s.root / "kwok-config.yaml").write_text(yaml.safe_dump(kwok_configuration(s)))
        ports = {
            name: pick_free_port()
            for name in ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
        }
        ports["kwok"] = pick_free_port()
        ports["kwok-node"] = pick_free_port()
        if node_settings is not None:
            ports["router"] = pick_free_port()
        server = f"https://127.0.0.1:{ports['kube-apiserver']}"
        self.kubeconfig.write_text(
            kubeconfig_document(
                server, pki.ca_cert, {"client-certificate": str(pki.admin_cert), "client-key": str(pki.admin_key)}
            )
        )
        self.kubeconfig.chmod(0o600)
        argv = component_argv(s, pki, ports, self.kubeconfig)
        if node_settings is not None:
            argv = with_real_node(argv, node_settings, pki)
        api = AdminApi(server, pki)
        try:
            if node_settings is not None:
                self._node = RealNode(node_settings)
                self._node.start_namespace(s.root / "logs")
                self._procs.update(self._node.procs)
                # The host reaches the control plane inside the namespace at the same port numbers.
                routes = [f"{ports[n]}=127.0.0.1:{ports[n]}" for n in FORWARDED]
                routes.append(f"{ports['router']}=service:{s.router_service}")
                self._node.start_forward(routes, s.root / "logs", server, pki)
                self._procs.update(self._node.procs)
                self._enter = self._node.enter()
            self._spawn("etcd", argv["etcd"])
            self._wait("etcd", lambda: etcd_healthy(f"http://127.0.0.1:{ports['etcd']}/health"))
            self._spawn("kube-apiserver", argv["kube-apiserver"])
            self._wait("kube-apiserver", lambda: api_ok(api, "/readyz"))
            self._spawn("kube-controller-manager", argv["kube-controller-manager"])
            self._spawn("kube-scheduler", argv["kube-scheduler"])
            for node in gpu_nodes(s.gpu_nodes, gpus=s.gpus_per_node, product=s.gpu_product):
                if node_settings is not None:
                    node["spec"]["taints"] = [KWOK_TAINT]
                status, body = api.call("POST", "/api/v1/nodes", node)
                if status not in (201, 409):
                    raise ControlPlaneError(f"creating node {node['metadata']['name']}: {status} {body}")
            self._spawn("kwok", argv["kwok"])
            # The service-account controller made `default` (pods need it): controller-manager works.
            self._wait(
                "kube-controller-manager",
                lambda: api_ok(api, "/api/v1/namespaces/default/serviceaccounts/default"),
            )
            self._wait("kube-scheduler", lambda: scheduler_ok(ports["kube-scheduler"]))
            self._wait("kwok", lambda: nodes_ready(api, s.gpu_nodes))
            if self._node is not None:
                self._node.start_node(api, pki, ports["kube-apiserver"], s.root / "logs")
                self._procs.update(self._node.procs)
        except BaseException:
            self._stop_procs()
            raise
        self.state = ClusterState(
            root=str(s.root),
            kubeconfig=str(self.kubeconfig),
            server=server,
            ports=ports,
            pids={name: proc.pid for name, proc in self._procs.items()},
            audit_log=str(s.root / "logs" / "audit.log"),
            node=None
            if self._node is None
            else {**self._node.state(), "router": f"http://127.0.0.1:{ports['router']}"},
        )
        self.state.save()
        return self.state

    def _stop_procs(self) -> None:
        """The node first (pods, cgroups, the namespace's stragglers), then the control plane, then
        the namespace holder and the forwarder."""
        # The node's processes too when its start failed half-way (not yet in ``_procs``).
        procs = {**self._procs, **(self._node.procs if self._node is not None else {})}
        if self._node is not None:
            self._node.stop_node({name: proc.pid for name, proc in procs.items()})
        terminate(procs)
        terminate(procs, NODE_FIRST)
        self._procs.clear()

    def stop(self) -> None:
        if self._procs:
            self._stop_procs()
        else:
            stop_root(self.settings.root)


@contextlib.contextmanager
def running(settings: ClusterSettings) -> Iterator[ControlPlane]:
    plane = ControlPlane(settings)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
