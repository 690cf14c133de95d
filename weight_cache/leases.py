"""Lease files: a process says "I use this model" by a file naming its pid and start time. A lease
whose process is gone (or whose pid was reused by another process) does not count.

The engine launcher pulls, then execs the engine: exec keeps the pid and the start time, so the
launcher's lease keeps protecting the model for as long as the engine runs.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

LEASE_SUFFIX = ".lease"


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces and parentheses; fields after the last ')' are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie has exited; it only waits to be reaped
        return -1
    return int(fields[19])


def is_alive(pid: int, start_ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    now = process_start_ticks(pid)
    if now == -1:
        return False
    return start_ticks is None or now is None or now == start_ticks


@dataclass
class Lease:
    path: Path
    digest: str

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def create_lease(directory: Path, digest: str, pid: int | None = None) -> Lease:
    pid = os.getpid() if pid is None else pid
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pid}-{uuid.uuid4().hex[:12]}{LEASE_SUFFIX}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, "startTicks": process_start_ticks(pid)}))
    os.replace(tmp, path)
    return Lease(path=path, digest=digest)


def live_leases(directory: Path, *, remove_dead: bool) -> list[Path]:
    """Leases whose process still runs; dead ones are deleted when ``remove_dead``."""
    if not directory.is_dir():
        return []
    alive: list[Path] = []
    for path in sorted(directory.glob(f"*{LEASE_SUFFIX}")):
        try:
            data = json.loads(path.read_text())
            live = is_alive(int(data["pid"]), data.get("startTicks"))
        except (OSError, ValueError, KeyError, TypeError):
            live = False  # unreadable or torn: its writer died mid-write
        if live:
            alive.append(path)
        elif remove_dead:
            path.unlink(missing_ok=True)
    return alive
