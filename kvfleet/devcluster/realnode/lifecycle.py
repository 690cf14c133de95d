"""The real node's start and stop sequence.

``RealNode.start_namespace`` starts the namespace holder; the control plane's components then run
inside it (their ``nsenter`` prefix is ``RealNode.enter``) so pods reach the API server at the node
address, and the host reaches them through ``forward``. ``start_node`` then starts containerd
(with the pause image imported), the cluster DNS (CoreDNS), the kubelet and kube-proxy, and waits
for the DNS and the Node to be Ready.

``stop_node`` is the teardown, shared by the process that started the node and ``kvfleet dev
cluster down`` (which only has the state file): pods removed through the CRI, every process still
in the kubelet's cgroup root or in the node's network namespace killed by its PID, the cgroup
folders removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ..admin import AdminApi, kubeconfig_document
from ..pki import Pki, issue_client_cert
from ..processes import PYTHON_MODULES, stop_pids
from . import cgroups, images
from .config import (
    cni_network,
    containerd_config,
    coredns_rbac,
    corefile,
    holder_plan,
    kube_proxy_config,
    kubelet_config,
    node_argv,
)
from .forward import NetnsSockets
from .settings import DNS_READY_PORT, DNS_USER, NODE_NAME, PAUSE_IMAGE, NodeError, NodeSettings

log = logging.getLogger(__name__)

PROGRAMS = PYTHON_MODULES


def netns_inode(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def processes_in_netns(inode: str) -> list[int]:
    """PIDs whose network namespace is ``inode`` (``net:[...]``): the node's own processes only."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == inode:
                    found.append(int(entry.name))
    return found


def _node_ready(api: AdminApi) -> str | None:
    status, body = api.call("GET", f"/api/v1/nodes/{NODE_NAME}", timeout_s=3)
    if status != 200:
        return f"node {NODE_NAME}: {status}"
    conditions = {c["type"]: c for c in body.get("status", {}).get("conditions", [])}
    ready = conditions.get("Ready", {})
    return None if ready.get("status") == "True" else f"Ready={ready.get('status')} {ready.get('message', '')}"


def _dns_ready(netns: str) -> str | None:
    """CoreDNS's ``/ready`` inside the namespace (200 once the kubernetes plugin has synced)."""
    try:
        sock = NetnsSockets(netns).tcp_socket()
    except OSError as e:
        return f"no socket in the namespace: {e}"
    with sock:
        sock.setblocking(True)
        sock.settimeout(2.0)
        try:
            sock.connect(("127.0.0.1", DNS_READY_PORT))
            sock.sendall(b"GET /ready HTTP/1.0\r\nHost: localhost\r\n\r\n")
            line = sock.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as e:
            return f"/ready: {e}"
    return None if " 200 " in f"{line} " else f"/ready: {line}"


def _take_store() -> tuple[Path | None, int]:
    """The shared containerd store and a locked descriptor on it, or (None, -1) when another
    cluster holds it (this one then keeps a store of its own, imported anew)."""
    store = images.node_store()
    store.mkdir(parents=True, exist_ok=True)
    fd = os.open(store / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        log.info("containerd's shared store %s is in use: this node keeps its own", store)
        return None, -1
    return store, fd


class RealNode:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def holder_pid(self) -> int:
        return self.procs["netns"].pid

    def enter(self) -> list[str]:
        """The prefix that runs a command inside the node's namespaces (nsenter execs it: same PID)."""
        pid = self.holder_pid
        return ["nsenter", f"--net=/proc/{pid}/ns/net", f"--mount=/proc/{pid}/ns/mnt", "--"]

    def _spawn(
        self, name: str, argv: list[str], log_dir: Path, pass_fds: tuple[int, ...] = ()
    ) -> subprocess.Popen[bytes]:
        with open(log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=pass_fds,
            )
        self.procs[name] = proc
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    def _wait(self, name: str, check: Any, log_dir: Path) -> None:
        from ..readiness import wait_ready

        try:
            wait_ready(check, name, self.settings.ready_timeout_s, log_dir / f"{name}.log", self.procs[name])
        except Exception as e:
            raise NodeError(str(e)) from e

    def start_namespace(self, log_dir: Path) -> None:
        s = self.settings
        s.root.mkdir(parents=True, exist_ok=True)
        plan = holder_plan(s)
        plan_file = s.root / "namespace.json"
        plan_file.write_text(json.dumps(plan, indent=2))
        Path(plan["ready_file"]).unlink(missing_ok=True)
        argv = ["unshare", "--net", "--mount", "--propagation", "private", "--"]
        self._spawn("netns", [*argv, sys.executable, "-m", PROGRAMS["netns"], str(plan_file)], log_dir)
        ready = Path(plan["ready_file"])
        self._wait("netns", lambda: None if ready.exists() else "setting up", log_dir)

    def start_forward(self, routes: list[str], log_dir: Path, server: str, pki: Pki) -> None:
        argv = [
            sys.executable,
            "-m",
            PROGRAMS["forward"],
            f"--netns=/proc/{self.holder_pid}/ns/net",
            f"--server={server}",
            f"--ca={pki.ca_cert}",
            f"--cert={pki.admin_cert}",
            f"--key={pki.admin_key}",
            *routes,
        ]
        self._spawn("forward", argv, log_dir)

    def start_node(self, api: AdminApi, pki: Pki, apiserver_port: int, log_dir: Path) -> None:
        s = self.settings
        (s.root / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        (s.root / "containerd").mkdir(parents=True, exist_ok=True)
        files = {
            "containerd": s.root / "containerd.toml",
            "kubelet": s.root / "kubelet.yaml",
            "kube-proxy": s.root / "kube-proxy.yaml",
            "kubelet-kubeconfig": s.root / "kubelet.kubeconfig",
            "kube-proxy-kubeconfig": s.root / "kube-proxy.kubeconfig",
            "coredns-kubeconfig": s.root / "coredns.kubeconfig",
            "corefile": s.root / "Corefile",
        }
        store, lock_fd = _take_store()
        files["containerd"].write_text(containerd_config(s, store))
        (s.root / "cni" / "net.d" / "10-kvfleet.conflist").write_text(json.dumps(cni_network(s), indent=2))
        files["kubelet"].write_text(yaml.safe_dump(kubelet_config(s, pki.ca_cert)))
        files["kube-proxy"].write_text(yaml.safe_dump(kube_proxy_config(s, files["kube-proxy-kubeconfig"])))
        files["corefile"].write_text(corefile(s, files["coredns-kubeconfig"]))
        server = f"https://{s.node_ip}:{apiserver_port}"
        identities = {
            "kubelet-kubeconfig": ("kubelet", f"system:node:{NODE_NAME}", "system:nodes"),
            "kube-proxy-kubeconfig": ("kube-proxy", "system:kube-proxy", None),
            "coredns-kubeconfig": ("coredns", DNS_USER, None),
        }
        for key, (stem, user, group) in identities.items():
            cert, keyfile = issue_client_cert(pki, s.root / "pki", stem, user, group)
            user_ref = {"client-certificate": str(cert), "client-key": str(keyfile)}
            files[key].write_text(kubeconfig_document(server, pki.ca_cert, user_ref))
            files[key].chmod(0o600)
        argv = node_argv(s, files)
        enter = self.enter()

        try:
            # containerd inherits the store's lock and holds it while it runs.
            self._spawn("containerd", [*enter, *argv["containerd"]], log_dir, (lock_fd,) if lock_fd >= 0 else ())
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)
        log.info("containerd's store: %s", store or s.root / "containerd" / "root")
        self._wait("containerd", lambda: None if s.containerd_socket.exists() else "no socket yet", log_dir)
        pause = images.files_image(PAUSE_IMAGE, {"/pause": s.bin_dir / "pause"}, ["/pause"])
        images.import_image(s.containerd_socket, pause)
        cgroups.make_root(s.cgroup_root)
        if "coredns" in argv:
            for collection, obj in coredns_rbac():
                status, body = api.call("POST", collection, obj)
                if status not in (201, 409):
                    raise NodeError(f"the cluster DNS's RBAC ({obj['kind']}): {status} {body}")
            self._spawn("coredns", [*enter, *argv["coredns"]], log_dir)
        self._spawn("kubelet", [*enter, *argv["kubelet"]], log_dir)
        self._spawn("kube-proxy", [*enter, *argv["kube-proxy"]], log_dir)
        if "coredns" in argv:
            netns = f"/proc/{self.holder_pid}/ns/net"
            self._wait("coredns", lambda: _dns_ready(netns), log_dir)
        self._wait("kubelet", lambda: _node_ready(api), log_dir)

    def state(self) -> dict[str, str]:
        s = self.settings
        inode = netns_inode(self.holder_pid) if "netns" in self.procs else None
        return {"root": str(s.root), "bin_dir": str(s.bin_dir), "cluster_id": s.cluster_id, "netns": inode or ""}

    def stop_node(self, pids: dict[str, int]) -> None:
        """The node's part of the teardown (also after a failed start); ``pids`` are every process
        of the cluster, so the namespace sweep spares the control plane that still runs in it."""
        inode = netns_inode(self.holder_pid) if "netns" in self.procs else None
        stop_node(self.settings, pids, inode, self.procs)


def remove_pods(settings: NodeSettings, timeout_s: float) -> None:
    """Every pod sandbox removed through the CRI, so containerd stops containers and shims cleanly."""
    if not settings.containerd_socket.exists():
        return
    crictl = [str(settings.bin_dir / "crictl"), f"--runtime-endpoint=unix://{settings.containerd_socket}"]
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        subprocess.run([*crictl, "rmp", "--all", "--force"], capture_output=True, timeout=timeout_s, check=False)


def _stop(
    names: list[str], pids: dict[str, int], handles: dict[str, subprocess.Popen[bytes]], timeout_s: float
) -> list[str]:
    """Our own children by their handles (even one still in nsenter, before it execs its program);
    a cluster another process started by its PIDs, checked to run our program."""
    by_handle = [n for n in names if n in handles]
    for name in by_handle:
        if handles[name].poll() is None:
            handles[name].terminate()
    for name in by_handle:
        try:
            handles[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            handles[name].kill()
            handles[name].wait(timeout=10)
    return by_handle + stop_pids(pids, [n for n in names if n in pids and n not in handles], timeout_s)


def stop_node(
    settings: NodeSettings,
    pids: dict[str, int],
    inode: str | None,
    handles: dict[str, subprocess.Popen[bytes]] | None = None,
) -> list[str]:
    """kube-proxy and the kubelet, then the pods, then containerd; then whatever still runs in the
    kubelet's cgroup root or the node's network namespace (containerd's shims, a container whose
    shim died), each killed by its PID; then the cgroup folders. Returns the names stopped."""
    handles = handles or {}
    timeout_s = settings.stop_timeout_s
    first = ("coredns", "kube-proxy", "kubelet")
    stopped = _stop([n for n in first if n in pids or n in handles], pids, handles, timeout_s)
    if "containerd" in pids or "containerd" in handles:
        remove_pods(settings, timeout_s)
        stopped += _stop(["containerd"], pids, handles, timeout_s)
    killed = cgroups.remove_root(settings.cgroup_root)
    if inode is not None:
        known = set(pids.values())
        strays = [pid for pid in processes_in_netns(inode) if pid not in known]
        for pid in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += strays
    if killed:
        log.info("killed %d processes left in the node's cgroup root and namespace", len(killed))
    return stopped


def settings_from_state(node: dict[str, str]) -> NodeSettings:
    return NodeSettings(root=Path(node["root"]), bin_dir=Path(node["bin_dir"]), cluster_id=node["cluster_id"])


def stop_node_from_state(node: dict[str, str], pids: dict[str, int]) -> list[str]:
    return stop_node(settings_from_state(node), pids, node.get("netns"))
