"""The CLI as a user runs it: a real subprocess of the installed console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def kvfleet(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_validates(example: Path) -> None:
    result = kvfleet("validate", "-f", str(example))
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"tiny.yaml", "llama-3.1-8b-h100.yaml", "qwen-72b-tp4.yaml"} <= names


def test_bad_specs_exit_2_with_field_paths() -> None:
    bad = Path(__file__).parent / "fixtures" / "bad-specs.yaml"
    result = kvfleet("validate", "-f", str(bad))
    assert result.returncode == 2
    err = result.stderr
    assert "(bad-autoscaling): spec.autoscaling.minReplicas: minReplicas (3) must be <= maxReplicas (1)" in err
    assert "(bad-scheme): spec.model.uri: unknown URI scheme 'gs'" in err
    assert "(bad-tp): spec.engine.tensorParallelSize:" in err
    assert "(typo): spec.replcas: unknown field 'replcas'" in err


def test_not_yaml_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("spec: [unclosed\n")
    result = kvfleet("validate", "-f", str(bad))
    assert result.returncode == 2
    assert "(yaml)" in result.stderr


def test_plan_prints_objects_for_tiny(repo_root: Path) -> None:
    result = kvfleet("plan", "-f", str(repo_root / "examples" / "tiny.yaml"), "-o", "json")
    assert result.returncode == 0, result.stderr
    assert '"kind"' in result.stdout


def test_crd_generate_check_passes(repo_root: Path) -> None:
    result = kvfleet("crd", "generate", "--check", cwd=repo_root)
    assert result.returncode == 0, result.stdout + result.stderr


def test_crd_generate_check_fails_when_stale(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text("# stale\n")
    result = kvfleet("crd", "generate", "--check", "--file", str(stale))
    assert result.returncode == 1
    assert "stale" in result.stderr
    assert kvfleet("crd", "generate", "--file", str(stale)).returncode == 0
    assert kvfleet("crd", "generate", "--check", "--file", str(stale)).returncode == 0


@pytest.mark.parametrize(
    ("command", "folder", "generated"),
    [
        (("crd", "generate"), "crds", "crds/inferencedeployments.kvfleet.io.yaml"),
        (("operator", "manifests"), "deploy", "deploy/operator.yaml"),
    ],
)
def test_generators_outside_a_checkout_ask_for_the_file(
    repo_root: Path, tmp_path: Path, command: tuple[str, ...], folder: str, generated: str
) -> None:
    """An installed kvfleet (the package alone, as in site-packages) has no checkout to write into:
    without --file the command says so and writes nothing; with --file it writes there."""
    site = tmp_path / "site-packages"
    shutil.copytree(repo_root / "kvfleet", site / "kvfleet", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvfleet.cli", *command, *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=120,
        )

    result = run("--check")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{site.resolve()} is not a kvfleet source checkout (no pyproject.toml and {folder}/" in result.stderr
    assert "pass --file PATH" in result.stderr
    assert sorted(p.name for p in site.iterdir()) == ["kvfleet"]
    written = tmp_path / "out" / "generated.yaml"
    assert run("--file", str(written)).returncode == 0
    assert written.read_text() == (repo_root / generated).read_text()


def _every_command() -> list[tuple[str, click.Command]]:
    """Every command of the CLI, lazy groups included, with its full name."""
    from kvfleet.cli import cli

    found: list[tuple[str, click.Command]] = []
    todo: list[tuple[str, click.Command]] = [("kvfleet", cli)]
    while todo:
        name, command = todo.pop()
        found.append((name, command))
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for sub in command.list_commands(ctx):
                child = command.get_command(ctx, sub)
                assert child is not None
                todo.append((f"{name} {sub}", child))
    return found


def test_output_means_a_format_everywhere() -> None:
    """kubectl's convention: -o/--output picks json or yaml (or a human view); a path is --file."""
    commands = _every_command()
    assert len(commands) > 25  # the walk reached the lazy groups
    with_output = []
    for name, command in commands:
        for param in command.params:
            if "--output" in getattr(param, "opts", []) or "-o" in getattr(param, "opts", []):
                assert isinstance(param.type, click.Choice), f"{name}: --output must be a format, not {param.type}"
                assert {"json", "yaml"} <= set(param.type.choices), name
                assert param.opts == ["-o", "--output"], name
                with_output.append(name)
    assert {"kvfleet plan", "kvfleet local status", "kvfleet operator manifests"} <= set(with_output)
    assert {"kvfleet artifacts fingerprint", "kvfleet dev cluster status"} <= set(with_output)


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_operator_manifests_print_in_either_format(fmt: str) -> None:
    import json

    import yaml

    result = kvfleet("operator", "manifests", "-o", fmt)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)["items"] if fmt == "json" else yaml.safe_load_all(result.stdout)
    items = [d for d in loaded if d]
    assert [i["kind"] for i in items][:2] == ["ServiceAccount", "ClusterRole"]


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_artifacts_fingerprint_prints_one_object(fmt: str) -> None:
    import json

    import yaml

    args = ["artifacts", "fingerprint", "--engine-name", "reference", "--engine-version", "0.1.0"]
    args += ["--model-digest", "a" * 64, "--gpu-product", "cpu"]
    text = kvfleet(*args).stdout
    result = kvfleet(*args, "-o", fmt)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout) if fmt == "json" else yaml.safe_load(result.stdout)
    # The same key and fields as the human output (its first line, then the fields as JSON).
    assert data["key"] == text.splitlines()[0]
    assert data["fields"] == json.loads(text.split("\n", 1)[1])


def test_dev_cluster_status_prints_data(tmp_path: Path) -> None:
    import json
    import os

    from kvfleet.devcluster.controlplane import ClusterState

    # A state file as `dev cluster up` writes it: this test process stands in as a running one.
    ClusterState(
        root=str(tmp_path),
        kubeconfig=str(tmp_path / "kubeconfig"),
        server="https://127.0.0.1:6443",
        ports={"apiserver": 6443},
        pids={"kube-apiserver": os.getpid(), "etcd": 2**22 + 1},
        audit_log=str(tmp_path / "audit.log"),
    ).save()
    result = kvfleet("dev", "cluster", "status", "--dir", str(tmp_path), "-o", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["server"] == "https://127.0.0.1:6443" and data["ports"] == {"apiserver": 6443}
    assert [(p["name"], p["running"]) for p in data["processes"]] == [("kube-apiserver", True), ("etcd", False)]
