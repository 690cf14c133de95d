"""RBAC as data, the rendered install file, and the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from kvfleet.operator.rbac import INSTALL_FILE, RULES, render_install


def kvfleet(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_rbac_has_no_wildcards_and_no_secrets() -> None:
    for rule in RULES:
        assert "*" not in rule.verbs and "*" not in rule.resources and rule.api_group != "*"
        assert "secrets" not in rule.resources
        assert rule.why
    granted = {(r.api_group, res): set(r.verbs) for r in RULES for res in r.resources}
    # Server-side apply creates a missing object, so it needs create besides patch; children are
    # read from watches (operator/child_cache.py), so list and watch.
    assert granted[("apps", "deployments")] == {"get", "list", "watch", "create", "patch"}  # no delete: GC does
    # The operator never updates (PUT) anything but the finalizers subresource for ownerReferences.
    assert all("update" not in verbs for key, verbs in granted.items() if key[1] != "inferencedeployments/finalizers")
    assert granted[("", "pods")] == {"list", "watch"}


def test_install_file_is_in_sync(repo_root: Path) -> None:
    assert kvfleet("operator", "manifests", "--check").returncode == 0
    docs = list(yaml.safe_load_all((repo_root / INSTALL_FILE).read_text()))
    assert docs == render_install()
    assert [d["kind"] for d in docs] == [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "ClusterKopfPeering",
    ]


def test_install_check_fails_when_stale(tmp_path: Path) -> None:
    stale = tmp_path / "operator.yaml"
    stale.write_text("# stale\n")
    result = kvfleet("operator", "manifests", "--check", "--file", str(stale))
    assert result.returncode == 1 and "stale" in result.stderr


def test_operator_run_help_and_bad_settings() -> None:
    result = kvfleet("operator", "run", "--help")
    assert result.returncode == 0 and "--router-endpoint" in result.stdout
    bad = kvfleet("operator", "run", "--resync-interval-s", "0")
    assert bad.returncode == 2 and "resync_interval_s" in bad.stderr


def test_plan_uses_the_operator_renderers(repo_root: Path) -> None:
    result = kvfleet("plan", "-f", str(repo_root / "examples" / "llama-3.1-8b-h100.yaml"), "-o", "json")
    assert result.returncode == 0, result.stderr
    items = json.loads(result.stdout)["items"]
    kinds = ["ConfigMap", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "ServiceMonitor"]
    assert [i["kind"] for i in items] == kinds
    assert items[1]["metadata"]["name"].endswith("-engine-pin") and items[1]["data"]["modelDigest"] == ""
    dep = items[3]
    assert dep["spec"]["replicas"] == 0  # minReplicas 0 and no autoscaler decision yet
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
