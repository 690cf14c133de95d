"""Stopping the processes tests start, so none is left behind."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM (the graceful stop every kvfleet server handles), then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
