"""When a component counts as up: polling a check (None when ready, else why not) to a deadline,
failing at once with the end of its log when the process exits, and the checks themselves (etcd
health, an API path that answers 200, the scheduler's healthz, the fake GPU nodes Ready)."""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .admin import AdminApi
from .settings import ControlPlaneError


def _log_tail(log_file: Path) -> str:
    if not log_file.exists():
        return ""
    tail = "\n  ".join(log_file.read_text(errors="replace").splitlines()[-15:])
    return f"; last lines of {log_file}:\n  {tail}"


def wait_ready(
    check: Callable[[], str | None], what: str, timeout_s: float, log_file: Path, proc: subprocess.Popen[bytes]
) -> None:
    """Poll ``check`` (None when ready, else why not) until ready or the deadline; a process that
    exited fails at once, with the end of its log."""
    deadline = time.monotonic() + timeout_s
    reason = "not checked yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ControlPlaneError(f"{what} exited with status {proc.returncode}{_log_tail(log_file)}")
        try:
            result = check()
        except (OSError, ValueError) as e:
            result = f"{type(e).__name__}: {e}"
        if result is None:
            return
        reason = result
        time.sleep(0.25)
    raise ControlPlaneError(f"{what} not ready after {timeout_s:.0f} s ({reason}){_log_tail(log_file)}")


def etcd_healthy(url: str) -> str | None:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback URL we built)
        body = response.read().decode()
    return None if response.status == 200 and '"health":"true"' in body.replace(" ", "") else body[:200]


def api_ok(api: AdminApi, path: str) -> str | None:
    status, body = api.call("GET", path, timeout_s=2)
    return None if status == 200 else f"{path}: {status} {str(body)[:200]}"


def scheduler_ok(port: int) -> str | None:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the scheduler's self-signed serving certificate
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2) as response:
        return None if response.status == 200 else f"healthz {response.status}"


def nodes_ready(api: AdminApi, count: int) -> str | None:
    status, body = api.call("GET", "/api/v1/nodes", timeout_s=2)
    if status != 200:
        return f"nodes: {status}"
    ready = [
        n["metadata"]["name"]
        for n in body.get("items", [])
        if any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in n.get("status", {}).get("conditions", [])
        )
    ]
    return None if len(ready) >= count else f"{len(ready)}/{count} nodes Ready"
