"""A real Kubernetes control plane as local processes: etcd, kube-apiserver (client certificates,
service-account tokens, RBAC, an audit log), kube-controller-manager, kube-scheduler, and kwok
nodes with fake GPUs. The way controller-runtime's envtest runs one, plus the controllers and the
fake kubelets that make Deployments produce scheduled, Ready pods with IPs.

``start`` brings everything up and waits until the API is ready, the controllers run and every
GPU node is Ready; ``stop`` ends every process it started. State (ports, PIDs) is written to
``<root>/state.json`` so ``kvfleet dev cluster down`` can stop a cluster another process started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfleet.free_port import pick_free_port

from .nodes import NODE_SELECTOR_ANNOTATION, gpu_nodes
from .pki import Pki, make_pki

log = logging.getLogger(__name__)

# Components in start order; ``stop`` goes in reverse so nothing loses the API under it.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
ADMIN_CONTEXT = "kvfleet-dev"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    # Metadata is enough to see who did what to which resource, and what the server answered.
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}


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
    audit_log_max_mb: int = 200  # rotated past this; tests read the audit log of their own run


@dataclass(frozen=True)
class ClusterState:
    """What ``start`` wrote and ``stop`` needs: ports, PIDs and where the files are."""

    root: str
    kubeconfig: str
    server: str
    ports: dict[str, int]
    pids: dict[str, int]
    audit_log: str
    started_at: float = field(default_factory=time.time)

    @classmethod
    def load(cls, root: Path) -> ClusterState | None:
        path = root / "state.json"
        if not path.exists():
            return None
        return cls(**json.loads(path.read_text()))

    def save(self) -> None:
        path = Path(self.root) / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)


def first_service_ip(cidr: str) -> str:
    import ipaddress

    return str(next(ipaddress.ip_network(cidr).hosts()))


def kubeconfig_document(server: str, ca_file: Path, user: dict[str, Any], *, name: str = ADMIN_CONTEXT) -> str:
    """A kubeconfig whose credentials are file references (nothing secret inline)."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    return yaml.safe_dump(doc, sort_keys=False)


def _binary(settings: ClusterSettings, name: str) -> str:
    path = settings.bin_dir / name
    if not os.access(path, os.X_OK):
        raise ControlPlaneError(f"{name} not found at {path}: build it with tools/k8s/build.sh")
    return str(path)


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
            "--concurrent-deployment-syncs=10",
            "--concurrent-replicaset-syncs=10",
        ],
        "kube-scheduler": [
            _binary(settings, "kube-scheduler"),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            f"--secure-port={ports['kube-scheduler']}",
            "--bind-address=127.0.0.1",
        ],
        "kwok": [
            _binary(settings, "kwok"),
            f"--kubeconfig={kc}",
            f"--config={settings.bin_dir.parent / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={NODE_SELECTOR_ANNOTATION}=fake",
            f"--cidr={settings.pod_cidr}",
            "--node-ip=127.0.0.1",
            f"--node-port={ports['kwok-node']}",
            f"--server-address=127.0.0.1:{ports['kwok']}",
        ],
    }


def _ssl_context(pki: Pki) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    return context


class AdminApi:
    """The few admin calls start-up needs, over urllib with the admin certificate (no client library
    import on the CLI's path; the tests use kubectl and kubernetes for everything else)."""

    def __init__(self, server: str, pki: Pki) -> None:
        self.server = server
        self._ssl = _ssl_context(pki)

    def call(self, method: str, path: str, body: Any = None, *, timeout_s: float = 10.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)  # noqa: S310 (https URL we built)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, context=self._ssl, timeout=timeout_s) as response:  # noqa: S310
                text = response.read().decode()
                return response.status, json.loads(text) if text.startswith(("{", "[")) else text
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text


def _log_tail(log_file: Path) -> str:
    if not log_file.exists():
        return ""
    tail = "\n  ".join(log_file.read_text(errors="replace").splitlines()[-15:])
    return f"; last lines of {log_file}:\n  {tail}"


def _wait(
    check: Callable[[], str | None], what: str, timeout_s: float, log_file: Path, proc: subprocess.Popen[bytes]
) -> None:
    """Poll ``check`` (None when ready, else why not) until ready or the deadline; a process that
    exited fails at once, with the end of its log."""
    deadline = time.monotonic() + timeout_s
    reason = "not checked yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ControlPlaneError(f"{what} exited with status {proc.returncode}{_log_tail(log_file)}")
        try:
            result = check()
        except (OSError, ValueError) as e:
            result = f"{type(e).__name__}: {e}"
        if result is None:
            return
        reason = result
        time.sleep(0.25)
    raise ControlPlaneError(f"{what} not ready after {timeout_s:.0f} s ({reason}){_log_tail(log_file)}")


class ControlPlane:
    """Start and stop one local control plane. Use as a context manager, or start/stop by hand."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.state: ClusterState | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

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
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        log.info("started %s (pid %d), log %s", name, self._procs[name].pid, log_path)

    def _wait(self, name: str, check: Callable[[], str | None]) -> None:
        log_file = self.settings.root / "logs" / f"{name}.log"
        _wait(check, name, self.settings.ready_timeout_s, log_file, self._procs[name])

    def start(self) -> ClusterState:
        s = self.settings
        existing = ClusterState.load(s.root)
        if existing is not None and any(_pid_alive(pid) for pid in existing.pids.values()):
            raise ControlPlaneError(f"a cluster is already running from {s.root}; stop it first (down)")
        for sub in ("pki", "logs", "etcd"):
            (s.root / sub).mkdir(parents=True, exist_ok=True)
        pki = make_pki(s.root / "pki", service_ip=first_service_ip(s.service_cidr))
        (s.root / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        ports = {
            name: pick_free_port()
            for name in ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
        }
        ports["kwok"] = pick_free_port()
        ports["kwok-node"] = pick_free_port()
        server = f"https://127.0.0.1:{ports['kube-apiserver']}"
        self.kubeconfig.write_text(
            kubeconfig_document(
                server, pki.ca_cert, {"client-certificate": str(pki.admin_cert), "client-key": str(pki.admin_key)}
            )
        )
        self.kubeconfig.chmod(0o600)
        argv = component_argv(s, pki, ports, self.kubeconfig)
        api = AdminApi(server, pki)
        try:
            self._spawn("etcd", argv["etcd"])
            self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{ports['etcd']}/health"))
            self._spawn("kube-apiserver", argv["kube-apiserver"])
            self._wait("kube-apiserver", lambda: _api_ok(api, "/readyz"))
            self._spawn("kube-controller-manager", argv["kube-controller-manager"])
            self._spawn("kube-scheduler", argv["kube-scheduler"])
            for node in gpu_nodes(s.gpu_nodes, gpus=s.gpus_per_node, product=s.gpu_product):
                status, body = api.call("POST", "/api/v1/nodes", node)
                if status not in (201, 409):
                    raise ControlPlaneError(f"creating node {node['metadata']['name']}: {status} {body}")
            self._spawn("kwok", argv["kwok"])
            # The service-account controller made `default` (pods need it): controller-manager works.
            self._wait(
                "kube-controller-manager",
                lambda: _api_ok(api, "/api/v1/namespaces/default/serviceaccounts/default"),
            )
            self._wait("kube-scheduler", lambda: _scheduler_ok(ports["kube-scheduler"]))
            self._wait("kwok", lambda: _nodes_ready(api, s.gpu_nodes))
        except BaseException:
            self._terminate(dict(self._procs))
            raise
        self.state = ClusterState(
            root=str(s.root),
            kubeconfig=str(self.kubeconfig),
            server=server,
            ports=ports,
            pids={name: proc.pid for name, proc in self._procs.items()},
            audit_log=str(s.root / "logs" / "audit.log"),
        )
        self.state.save()
        return self.state

    def stop(self) -> None:
        if self._procs:
            self._terminate(dict(self._procs))
            self._procs.clear()
        else:
            stop_root(self.settings.root)

    @staticmethod
    def _terminate(procs: dict[str, subprocess.Popen[bytes]]) -> None:
        for name in reversed(COMPONENTS):
            proc = procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for name in reversed(COMPONENTS):
            proc = procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _pid_alive(pid: int) -> bool:
    """Running (a zombie whose parent has not reaped it yet has stopped: it counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust the signal check
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _is_component(pid: int) -> bool:
    """The PID still runs one of our binaries (not a process that reused the number)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return False
    return Path(cmdline).name in COMPONENTS


def stop_root(root: Path, *, timeout_s: float = 10.0) -> list[str]:
    """Stop the processes of the cluster whose state is under ``root``; returns the stopped names."""
    state = ClusterState.load(root)
    if state is None:
        return []
    stopped = []
    order = [n for n in reversed(COMPONENTS) if n in state.pids]
    for name in order:
        pid = state.pids[name]
        if _pid_alive(pid) and _is_component(pid):
            os.kill(pid, signal.SIGTERM)
            stopped.append(name)
    deadline = time.monotonic() + timeout_s
    for name in stopped:
        pid = state.pids[name]
        while _pid_alive(pid) and _is_component(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(pid) and _is_component(pid):
            os.kill(pid, signal.SIGKILL)
    return stopped


def _http_ok(url: str) -> str | None:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback URL we built)
        body = response.read().decode()
    return None if response.status == 200 and '"health":"true"' in body.replace(" ", "") else body[:200]


def _api_ok(api: AdminApi, path: str) -> str | None:
    status, body = api.call("GET", path, timeout_s=2)
    return None if status == 200 else f"{path}: {status} {str(body)[:200]}"


def _scheduler_ok(port: int) -> str | None:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the scheduler's self-signed serving certificate
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2) as response:
        return None if response.status == 200 else f"healthz {response.status}"


def _nodes_ready(api: AdminApi, count: int) -> str | None:
    status, body = api.call("GET", "/api/v1/nodes", timeout_s=2)
    if status != 200:
        return f"nodes: {status}"
    ready = [
        n["metadata"]["name"]
        for n in body.get("items", [])
        if any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in n.get("status", {}).get("conditions", [])
        )
    ]
    return None if len(ready) >= count else f"{len(ready)}/{count} nodes Ready"


@contextlib.contextmanager
def running(settings: ClusterSettings) -> Iterator[ControlPlane]:
    plane = ControlPlane(settings)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
