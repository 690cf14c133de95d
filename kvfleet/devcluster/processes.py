"""The cluster's running processes: the state file (``<root>/state.json``: ports, PIDs, where the
files are) that lets ``kvfleet dev cluster down`` stop a cluster another process started, and
stopping them, by handle or by PID (checked to still run one of our binaries first)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .settings import COMPONENTS

# A real node's processes around the control plane (kvfleet.devcluster.realnode): the namespace
# holder and the port forwarder first (the control plane runs inside the namespace), the node last.
NODE_FIRST = ("netns", "forward")
NODE_LAST = ("containerd", "coredns", "kubelet", "kube-proxy")
START_ORDER = (*NODE_FIRST, *COMPONENTS, *NODE_LAST)
# Python processes are known by their module; binaries by their name.
PYTHON_MODULES = {
    "netns": "kvfleet.devcluster.realnode.namespace",
    "forward": "kvfleet.devcluster.realnode.forward",
}


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
    # With a real node: its settings (root, bin_dir, cluster_id), its network namespace's inode
    # and the router's host address; None for kwok nodes only.
    node: dict[str, str] | None = None

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


def terminate(procs: dict[str, subprocess.Popen[bytes]], names: tuple[str, ...] = COMPONENTS) -> None:
    """Stop the processes this one started, in reverse start order; kill what does not stop in 10 s."""
    for name in reversed(names):
        proc = procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.terminate()
    for name in reversed(names):
        proc = procs.get(name)
        if proc is None:
            continue
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def pid_alive(pid: int) -> bool:
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


def is_component(pid: int, name: str | None = None) -> bool:
    """The PID still runs one of our programs (``name``'s when given), not a process that reused
    the number."""
    try:
        words = [w.decode(errors="replace") for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return False
    names = (name,) if name else START_ORDER
    for candidate in names:
        module = PYTHON_MODULES.get(candidate)
        if (module and module in words) or (not module and Path(words[0]).name == candidate):
            return True
    return False


def stop_pids(pids: dict[str, int], names: list[str], timeout_s: float) -> list[str]:
    """SIGTERM each of ``names`` still running our program, together; SIGKILL what remains after
    ``timeout_s``. Returns the names that were running."""
    stopped = []
    for name in names:
        pid = pids[name]
        if pid_alive(pid) and is_component(pid, name):
            os.kill(pid, signal.SIGTERM)
            stopped.append(name)
    deadline = time.monotonic() + timeout_s
    for name in stopped:
        pid = pids[name]
        while pid_alive(pid) and is_component(pid, name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid) and is_component(pid, name):
            os.kill(pid, signal.SIGKILL)
    return stopped


def stop_root(root: Path, *, timeout_s: float = 10.0) -> list[str]:
    """Stop the processes of the cluster whose state is under ``root``; returns the stopped names.
    With a real node: the node first (its pods, cgroups and namespace's stragglers included), then
    the control plane, then the namespace holder and the forwarder."""
    state = ClusterState.load(root)
    if state is None:
        return []
    stopped = []
    if state.node is not None:
        from .realnode.lifecycle import stop_node_from_state

        stopped += stop_node_from_state(state.node, state.pids)
    stopped += stop_pids(state.pids, [n for n in reversed(COMPONENTS) if n in state.pids], timeout_s)
    stopped += stop_pids(state.pids, [n for n in reversed(NODE_FIRST) if n in state.pids], timeout_s)
    return stopped
