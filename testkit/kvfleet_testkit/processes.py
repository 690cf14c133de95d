"""Stopping the processes tests start, so none is left behind."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path


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


def console_script(name: str = "kvfleet") -> str:
    """A console script of the environment running the tests: beside the interpreter (a venv's
    bin/, not resolved through its symlink), else on PATH. Never a hard-coded .venv."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name!r} console script beside {sys.executable} or on PATH: pip install -e .")
    return found
