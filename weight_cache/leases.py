"""Lease files: a process says "I use this model" by holding a lock on a lease file of its own.

The lock is ``flock`` on the file itself, so it means the same thing to every process that sees the
file: across pods on one node (the node cache is a hostPath shared by several pods, each with its
own PID namespace) a pid means nothing, but a lock held on the same inode does. A lease is live
while its holder's open file description exists: the holder may crash, be OOM-killed or exec
(the descriptor is inherited), and the kernel releases the lock when the last copy closes.
The file also names the holder (pid in its own namespace, hostname) for people reading the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

LEASE_SUFFIX = ".lease"


@dataclass
class ModelLease:
    """This process's hold on one cached model (``digest``): eviction spares a model with a live one.
    Not a Kubernetes Lease (the autoscaler's leader election) nor a router's hold on a replica."""

    path: Path
    digest: str
    fd: int = -1  # the locked descriptor; closing it (or the process ending) ends the lease

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_lease(directory: Path, digest: str, *, inheritable: bool = True) -> ModelLease:
    """A new lease, locked by this process (and by whatever it execs, when ``inheritable``)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = uuid.uuid4().hex
    path = directory / f"{name}{LEASE_SUFFIX}"
    # Locked under a name no reader looks at, then renamed into place (the lock follows the inode):
    # a reader never sees the lease unlocked and takes it for a dead one.
    staging = directory / f"{name}.locking"
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file nobody else has opened: never blocks
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        os.set_inheritable(fd, inheritable)
        os.replace(staging, path)
    except BaseException:
        os.close(fd)
        staging.unlink(missing_ok=True)
        raise
    return ModelLease(path=path, digest=digest, fd=fd)


def is_held(path: Path) -> bool:
    """Someone holds the lease's lock (this process too, through another descriptor)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock, if it got one
    return False


def live_leases(directory: Path, *, remove_dead: bool) -> list[Path]:
    """Leases whose process still runs; dead ones are deleted when ``remove_dead``."""
    if not directory.is_dir():
        return []
    alive: list[Path] = []
    for path in sorted(directory.glob(f"*{LEASE_SUFFIX}")):
        if is_held(path):
            alive.append(path)
        elif remove_dead:
            path.unlink(missing_ok=True)
    return alive
