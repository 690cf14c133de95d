"""The kubelet's cgroup root on the host's cgroup file systems (v1: one folder per hierarchy; v2:
one folder): made before the kubelet starts, and at teardown every process still in it is killed
by its PID and every folder under it removed, deepest first. Nothing outside it is touched."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CGROUP_FS = ("cgroup", "cgroup2")


def hierarchies(mounts: str | None = None) -> list[Path]:
    """Mount points of the cgroup file systems (from /proc/self/mounts)."""
    text = mounts if mounts is not None else Path("/proc/self/mounts").read_text()
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] in CGROUP_FS:
            found.append(Path(parts[1]))
    return found


def make_root(name: str) -> list[Path]:
    """``name`` (``/kvfleet-...``) in every hierarchy; a new cpuset folder gets its parent's CPUs
    and memory nodes, without which no process may join it."""
    made = []
    for base in hierarchies():
        folder = base / name.strip("/")
        folder.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            child = folder / knob
            if child.exists() and not child.read_text().strip():
                child.write_text((base / knob).read_text())
        made.append(folder)
    return made


def _descendants(folder: Path) -> list[Path]:
    """Every folder under ``folder``, deepest first, ``folder`` last."""
    found = [Path(d) for d, _, _ in os.walk(folder)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def processes(name: str) -> set[int]:
    pids: set[int] = set()
    for base in hierarchies():
        folder = base / name.strip("/")
        if not folder.is_dir():
            continue
        for sub in _descendants(folder):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (sub / "cgroup.procs").read_text().split())
    return pids


def remove_root(name: str, *, timeout_s: float = 10.0) -> list[int]:
    """Kill what still runs under ``name`` (SIGKILL, by PID), then remove its folders. Returns
    the PIDs killed; raises OSError naming a folder that would not go."""
    killed = sorted(processes(name))
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while processes(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    for base in hierarchies():
        folder = base / name.strip("/")
        if not folder.is_dir():
            continue
        for sub in _descendants(folder):
            for attempt in range(50):  # an emptied cgroup may stay busy for a moment
                try:
                    sub.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 49:
                        raise
                    time.sleep(0.1)
    return killed
