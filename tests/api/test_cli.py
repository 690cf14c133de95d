"""The CLI as a user runs it: a real subprocess of the installed console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    result = kvfleet("crd", "generate", "--check", "--output", str(stale))
    assert result.returncode == 1
    assert "stale" in result.stderr
    assert kvfleet("crd", "generate", "--output", str(stale)).returncode == 0
    assert kvfleet("crd", "generate", "--check", "--output", str(stale)).returncode == 0
