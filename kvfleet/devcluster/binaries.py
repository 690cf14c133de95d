"""Where the control plane's binaries come from: ``KVFLEET_K8S_BIN`` when set, else the source
checkout's ``tools/k8s/build.sh``, which builds them from Go modules into a cache outside the
repository (minutes the first time, then seconds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    given = os.environ.get(BIN_ENV)
    if given:
        bin_dir = Path(given)
        if gone := missing(bin_dir):
            raise ControlPlaneError(f"{BIN_ENV}={given} lacks {', '.join(gone)}")
        return bin_dir
    if not BUILD_SCRIPT.exists():
        raise ControlPlaneError(
            f"no binaries: set {BIN_ENV} to a folder with {', '.join(NEEDED)}, "
            "or run from a source checkout (tools/k8s/build.sh builds them)"
        )
    if shutil.which("go") is None:
        raise ControlPlaneError(f"building the control plane needs Go >= 1.26 on PATH (or set {BIN_ENV})")
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else sys.stderr,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise ControlPlaneError(f"tools/k8s/build.sh failed (exit {result.returncode}); its output says why")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    if gone := missing(bin_dir):
        raise ControlPlaneError(f"tools/k8s/build.sh finished but {bin_dir} lacks {', '.join(gone)}")
    return bin_dir
