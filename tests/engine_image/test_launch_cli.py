"""The launcher as a process, as the pod runs it: exit codes and the one failure line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import pick_free_port

LAUNCH = [sys.executable, "-m", "kvfleet.engine_image.launch_cli"]


def run_launch(tmp_path: Path, doc: object) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    args = ["--spec", str(spec), "--node-cache-dir", str(tmp_path / "cache"), "--metrics-host", "127.0.0.1"]
    args += ["--metrics-port", str(pick_free_port()), "--engine-port", str(pick_free_port())]
    # Where the kubelet would read the termination message (/dev/termination-log in a pod).
    env = {**os.environ, "KVFLEET_TERMINATION_LOG": str(tmp_path / "termination-log")}
    return subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=60, env=env)


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kvfleet launcher failed")]


def test_invalid_spec_exits_2_naming_the_field(tmp_path: Path) -> None:
    doc = {"name": "tiny", "spec": {"model": {"uri": "file:///m"}, "engine": {"kind": "reference", "dtype": "fp4"}}}
    result = run_launch(tmp_path, doc)
    assert result.returncode == 2
    (line,) = failure_lines(result.stderr)
    assert line.startswith("kvfleet launcher failed in phase spec: spec.engine.dtype:")


def test_missing_weights_exit_3_naming_the_pull_phase(tmp_path: Path) -> None:
    model = tmp_path / "no-model"
    doc = {
        "name": "tiny",
        "spec": {"model": {"uri": f"file://{model}"}, "engine": {"kind": "reference"}, "resources": {"gpus": 0}},
    }
    result = run_launch(tmp_path, doc)
    assert result.returncode == 3
    assert failure_lines(result.stderr) == [
        f"kvfleet launcher failed in phase pull: no model at {model} (config.json is missing)"
    ]
    # The same line is the container's termination message, which the operator surfaces.
    assert (tmp_path / "termination-log").read_text() == failure_lines(result.stderr)[0]


def test_missing_spec_file(tmp_path: Path) -> None:
    result = subprocess.run(
        [*LAUNCH, "--spec", str(tmp_path / "absent.json")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    (line,) = failure_lines(result.stderr)
    assert "cannot read" in line and "absent.json" in line


def test_the_images_entrypoint_sits_beside_the_engines_own_commands(tmp_path: Path) -> None:
    """`kvfleet engine launch` (the pods' entrypoint) reaches the launcher through the top-level CLI,
    beside `serve` and `make-tiny-model`, though the engine package does not import the launcher."""
    kvfleet = [sys.executable, "-c", "from kvfleet.cli import main; main()"]
    listed = subprocess.run([*kvfleet, "engine", "--help"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    commands = listed.stdout.split("Commands:")[1].split()
    assert {"launch", "serve", "make-tiny-model"} <= set(commands)
    result = subprocess.run(
        [*kvfleet, "engine", "launch", "--spec", str(tmp_path / "absent.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    (line,) = failure_lines(result.stderr)
    assert "cannot read" in line and "absent.json" in line
