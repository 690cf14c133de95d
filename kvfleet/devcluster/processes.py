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


def terminate(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Stop the processes this one started, in reverse start order; kill what does not stop in 10 s."""
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


def is_component(pid: int) -> bool:
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
        if pid_alive(pid) and is_component(pid):
            os.kill(pid, signal.SIGTERM)
            stopped.append(name)
    deadline = time.monotonic() + timeout_s
    for name in stopped:
        pid = state.pids[name]
        while pid_alive(pid) and is_component(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid) and is_component(pid):
            os.kill(pid, signal.SIGKILL)
    return stopped
