"""Children die with local mode even when it is killed with SIGKILL (no orphans)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT = """
import asyncio, sys
from pathlib import Path
from kvfleet.local.processes import spawn

async def main():
    child = await spawn([sys.executable, "-c", "import time; time.sleep(60)"], Path(sys.argv[1]))
    print(child.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_child_is_killed_when_parent_is_killed(tmp_path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        # The child is in its own session, so a terminal's Ctrl-C does not reach it directly.
        assert os.getsid(child_pid) == child_pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(child_pid), "child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()
