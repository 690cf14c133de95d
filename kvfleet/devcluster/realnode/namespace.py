"""The process that holds the real node's network and mount namespaces.

Started as ``unshare --net --mount --propagation private -- python -m
kvfleet.devcluster.realnode.namespace PLAN.json``: it bind-mounts a file holding each kubelet
sysctl's wanted value over its /proc/sys entry and the node's own folders over /var/lib, /var/log
and /run (visible only in this mount namespace), gives the namespace's loopback the node address
and a default route (so Service addresses route before kube-proxy's rules rewrite them), writes
its ready file, and waits for SIGTERM. Every node component joins these namespaces with
``nsenter``; when they and this process end, the namespaces and everything mounted in them go.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"namespace holder: {' '.join(argv)} failed: {result.stderr.strip()}")


def setup(plan: dict[str, object], state_dir: Path) -> None:
    sysctls = plan["sysctls"]
    private = plan["private_dirs"]
    assert isinstance(sysctls, dict) and isinstance(private, dict)
    values = state_dir / "sysctl"
    values.mkdir(parents=True, exist_ok=True)
    for entry, value in sysctls.items():
        if not Path(entry).exists():
            continue  # a kernel without this knob: the kubelet skips it too
        file = values / entry.removeprefix("/proc/sys/").replace("/", ".")
        file.write_text(f"{value}\n")
        _run("mount", "--bind", str(file), entry)
    for target, source in private.items():
        Path(source).mkdir(parents=True, exist_ok=True)
        _run("mount", "--bind", source, target)
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "addr", "add", f"{plan['node_ip']}/32", "dev", "lo")
    _run("ip", "route", "add", "default", "dev", "lo", "src", str(plan["node_ip"]))


def main() -> None:
    plan_file = Path(sys.argv[1])
    plan = json.loads(plan_file.read_text())
    # Blocked before anything else: a SIGTERM during set-up is waited for, never lost.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    setup(plan, plan_file.parent)
    Path(plan["ready_file"]).write_text("ready\n")
    signal.sigwait(stop_signals)


if __name__ == "__main__":
    main()
