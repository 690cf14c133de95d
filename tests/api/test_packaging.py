"""The folder-to-subpackage mapping holds, and nothing shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path


def test_every_package_folder_is_listed(repo_root: Path) -> None:
    config = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = config["package-dir"]
    listed = set(config["packages"])
    folders = {v: k for k, v in package_dir.items()}
    found = set()
    for init in repo_root.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(repo_root)
        top = rel.parts[0]
        if top not in folders:
            continue
        found.add(".".join([folders[top], *rel.parts[1:]]))
    assert found == listed, f"packages missing from pyproject: {found - listed}; stale: {listed - found}"


def test_stdlib_operator_is_not_shadowed(repo_root: Path) -> None:
    code = "import operator, kvfleet.operator; operator.add; print(kvfleet.operator.__name__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "kvfleet.operator"


def test_torch_is_pinned(repo_root: Path) -> None:
    deps = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in deps
