"""The folder-to-subpackage mapping holds, nothing shadows the standard library, and the control
plane installs and runs without the engine extra (no torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest


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


def test_torch_is_pinned_in_the_engine_extra_only(repo_root: Path) -> None:
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["optional-dependencies"]["engine"]
    heavy = ("torch", "safetensors", "tokenizers", "numpy", "jinja2")
    assert not [d for d in project["dependencies"] if d.split("=")[0].split(">")[0].strip() in heavy]
    # The tests need the engine, so the test extra brings it.
    assert "kvfleet[engine]" in project["optional-dependencies"]["test"]


# Every control-plane command, and what a user runs before deploying: none may need torch.
CONTROL_PLANE_COMMANDS = [
    ["--help"],
    ["operator", "run", "--help"],
    ["operator", "manifests", "--help"],
    ["router", "serve", "--help"],
    ["autoscaler", "run", "--help"],
    ["crd", "generate", "--help"],
    ["dev", "cluster", "--help"],
    ["cache", "--help"],
    ["artifacts", "--help"],
    ["engine", "launch", "--help"],
    ["validate", "-f", "examples/tiny.yaml"],
    ["plan", "-f", "examples/tiny.yaml", "-o", "json"],
]
# Imported whole in the venv: a module-level `import torch` anywhere in them fails the test even
# where no --help reaches it.
CONTROL_PLANE_PACKAGES = [
    "kvfleet.operator",
    "kvfleet.router",
    "kvfleet.autoscaler",
    "kvfleet.weight_cache",
    "kvfleet.engine_image",
    "kvfleet.devcluster",
]


def _install_without_engine(repo_root: Path, venv: Path, extras: str = "") -> None:
    """A fresh venv with kvfleet installed as a wheel from a copy of the sources (as the
    control-plane image does), no extras. Offline from uv's cache when it holds everything."""
    from uv import find_uv_bin

    uv = find_uv_bin()
    src = venv.parent / "src"
    src.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy2(repo_root / name, src / name)
    config = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in config["package-dir"].values():
        shutil.copytree(repo_root / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([uv, "venv", "-q", "--python", base, str(venv)], check=True, timeout=60)
    install = [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), f"{src}{extras}"]
    offline = subprocess.run([*install, "--offline"], capture_output=True, text=True, timeout=240)
    if offline.returncode != 0:
        # A cache without some package (a fresh machine): let uv fetch it.
        online = subprocess.run(install, capture_output=True, text=True, timeout=240)
        assert online.returncode == 0, offline.stderr + online.stderr


@pytest.mark.slow
def test_control_plane_runs_without_the_engine_extra(repo_root: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _install_without_engine(repo_root, venv)
    python = venv / "bin" / "python"
    kvfleet = venv / "bin" / "kvfleet"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    probe = (
        "import importlib, importlib.util, pkgutil, sys\n"
        "absent = [m for m in ('torch', 'safetensors', 'tokenizers') if importlib.util.find_spec(m)]\n"
        "assert not absent, f'installed without the engine extra: {absent}'\n"
        f"for name in {CONTROL_PLANE_PACKAGES!r}:\n"
        "    package = importlib.import_module(name)\n"
        "    for info in pkgutil.walk_packages(package.__path__, name + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print(len(sys.modules))\n"
    )
    result = subprocess.run(
        [str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr

    outputs = {}
    for args in CONTROL_PLANE_COMMANDS:
        result = subprocess.run(
            [str(kvfleet), *args], cwd=repo_root, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"kvfleet {' '.join(args)}: {result.stderr}"
        outputs[args[0]] = result.stdout
    assert "default/tiny is valid" in outputs["validate"]
    assert '"kind": "Deployment"' in outputs["plan"]

    # The engine itself says what to install instead of failing in an import.
    result = subprocess.run(
        [str(kvfleet), "engine", "serve", "--model", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "pip install 'kvfleet[engine]'" in result.stderr and "torch" in result.stderr


@pytest.mark.slow
def test_the_control_plane_images_router_tokenizes_without_torch(repo_root: Path, tmp_path: Path) -> None:
    """The image's kv-events extra is enough for the router's prompt tokenizer (docs/router.md)."""
    from kvfleet.engine.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", layers=1, hidden=32, vocab=512)
    venv = tmp_path / "venv"
    _install_without_engine(repo_root, venv, "[kv-events]")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = (
        "import importlib.util, sys\n"
        "from pathlib import Path\n"
        "from kvfleet.router.prompt_tokens import load_tokenizer, prompt_token_ids\n"
        "assert importlib.util.find_spec('torch') is None\n"
        f"tokenizer = load_tokenizer(Path({str(model)!r}))\n"
        "print(len(prompt_token_ids(tokenizer, {'prompt': 'hello world'}) or []))\n"
    )
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0
