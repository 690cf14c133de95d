"""Where the real node's binaries come from: ``KVFLEET_NODE_BIN`` when set, else the source
checkout's ``tools/node/build.sh`` (kubelet, kube-proxy, crictl, pause: minutes the first time,
then seconds); the cluster DNS from ``KVFLEET_COREDNS_BIN`` or ``tools/coredns/build.sh``.
containerd, runc, ctr and the CNI plugins are Debian's (scripts/bootstrap)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..binaries import ensure_built
from .settings import NodeError

BIN_ENV = "KVFLEET_NODE_BIN"
BUILD_SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "node" / "build.sh"
DNS_BIN_ENV = "KVFLEET_COREDNS_BIN"
DNS_BUILD_SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "coredns" / "build.sh"
BUILD_TIMEOUT_S = 3600.0  # kubelet cold on 2 cores: ~5 min once the control plane's packages are cached
NEEDED = ("kubelet", "kube-proxy", "crictl", "pause")
# From Debian (scripts/bootstrap --with-node), and util-linux / iproute2 for the namespace.
SYSTEM_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "unshare", "nsenter", "ip", "iptables")


def missing(bin_dir: Path) -> list[str]:
    return [name for name in NEEDED if not os.access(bin_dir / name, os.X_OK)]


def missing_system_tools(cni_bin_dir: Path) -> list[str]:
    gone = [t for t in SYSTEM_TOOLS if shutil.which(t) is None and not os.access(f"/usr/sbin/{t}", os.X_OK)]
    gone += [
        f"{cni_bin_dir}/{p}" for p in ("bridge", "host-local", "loopback", "portmap") if not (cni_bin_dir / p).exists()
    ]
    return gone


def ensure_node_binaries(*, quiet: bool = False) -> Path:
    return ensure_built(
        bin_env=BIN_ENV,
        build_script=BUILD_SCRIPT,
        missing=missing,
        error=NodeError,
        what="the real node",
        timeout_s=BUILD_TIMEOUT_S,
        quiet=quiet,
    )


def ensure_coredns(*, quiet: bool = False) -> Path:
    """The cluster DNS's binary: ``$KVFLEET_COREDNS_BIN/coredns``, else tools/coredns/build.sh's."""
    bin_dir = ensure_built(
        bin_env=DNS_BIN_ENV,
        build_script=DNS_BUILD_SCRIPT,
        missing=lambda d: [] if os.access(d / "coredns", os.X_OK) else ["coredns"],
        error=NodeError,
        what="the node's cluster DNS",
        timeout_s=BUILD_TIMEOUT_S,
        quiet=quiet,
    )
    return bin_dir / "coredns"
