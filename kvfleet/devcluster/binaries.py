"""Where the control plane's binaries come from: ``KVFLEET_K8S_BIN`` when set, else the source
checkout's ``tools/k8s/build.sh``, which builds them from Go modules into a cache outside the
repository (minutes the first time, then seconds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .settings import COMPONENTS, ControlPlaneError

BIN_ENV = "KVFLEET_K8S_BIN"
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "k8s" / "build.sh"
BUILD_TIMEOUT_S = 3600.0  # a cold build on 2 cores takes ~25 min; past an hour something is wrong
NEEDED = (*COMPONENTS, "helm")


def missing(bin_dir: Path) -> list[str]:
    return [name for name in NEEDED if not os.access(bin_dir / name, os.X_OK)]


def ensure_binaries(*, quiet: bool = False) -> Path:
    """The folder holding every binary, building it when needed; raises with the reason otherwise."""
    return ensure_built(
        bin_env=BIN_ENV,
        build_script=BUILD_SCRIPT,
        missing=missing,
        error=ControlPlaneError,
        what="the control plane",
        timeout_s=BUILD_TIMEOUT_S,
        quiet=quiet,
    )


def ensure_built(
    *,
    bin_env: str,
    build_script: Path,
    missing: Callable[[Path], list[str]],
    error: type[Exception],
    what: str,
    timeout_s: float,
    quiet: bool,
) -> Path:
    """A Go-built binaries folder: ``$bin_env`` when set (checked, never built), else what
    ``build_script`` prints on its last line after building or finding its cache; ``error`` with
    the reason otherwise. Shared by the control plane's and the real node's binaries."""
    given = os.environ.get(bin_env)
    if given:
        bin_dir = Path(given)
        if gone := missing(bin_dir):
            raise error(f"{bin_env}={given} lacks {', '.join(gone)}")
        return bin_dir
    script = f"tools/{build_script.parent.name}/{build_script.name}"
    if not build_script.exists():
        raise error(
            f"no binaries for {what}: set {bin_env} to a folder with them, "
            f"or run from a source checkout ({script} builds them)"
        )
    if shutil.which("go") is None:
        raise error(f"building {what} needs Go >= 1.26 on PATH (or set {bin_env})")
    result = subprocess.run(
        ["bash", str(build_script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else sys.stderr,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0:
        raise error(f"{script} failed (exit {result.returncode}); its output says why")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    if gone := missing(bin_dir):
        raise error(f"{script} finished but {bin_dir} lacks {', '.join(gone)}")
    return bin_dir
