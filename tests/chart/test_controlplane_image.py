"""The control-plane image (the repository's root Dockerfile), checked statically as the engine
images are (no Docker engine on this machine), and against what the chart runs it with."""

from __future__ import annotations

import io
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from .conftest import CHART, CI_VALUES, load_values

VERSION_TAG = re.compile(r"^v?\d+(\.\d+)+([.-][A-Za-z0-9.]+)*$")


@pytest.fixture
def dockerfile(repo_root: Path) -> DockerfileParser:
    # The parser reads its file object lazily, so hand it one that stays open.
    return DockerfileParser(fileobj=io.BytesIO((repo_root / "Dockerfile").read_bytes()))


def instructions(parser: DockerfileParser, kind: str) -> list[dict[str, Any]]:
    return [i for i in parser.structure if i["instruction"] == kind]


def final_stage(parser: DockerfileParser) -> list[dict[str, Any]]:
    froms = [n for n, i in enumerate(parser.structure) if i["instruction"] == "FROM"]
    return parser.structure[froms[-1] :]


def test_base_is_pinned_by_version(repo_root: Path, dockerfile: DockerfileParser) -> None:
    args = dict(i["value"].split("=", 1) for i in instructions(dockerfile, "ARG") if "=" in i["value"])
    image = args["PYTHON_IMAGE"]
    repository, _, tag = image.partition("@")[0].rpartition(":")
    assert repository == "python"
    assert VERSION_TAG.match(tag.split("-")[0]) and "slim" in tag, f"{image}: pin a slim base by version"
    # Every stage builds on that pinned base.
    assert {i["value"].split()[0] for i in instructions(dockerfile, "FROM")} == {"${PYTHON_IMAGE}"}
    text = (repo_root / "Dockerfile").read_text()
    assert "@sha256:<digest>" in text and "imagetools inspect" in text


def test_runs_as_the_charts_non_root_uid(dockerfile: DockerfileParser) -> None:
    users = [i for i in final_stage(dockerfile) if i["instruction"] == "USER"]
    assert users, "no USER in the final stage: the image would run as root"
    uid, _, gid = users[-1]["value"].partition(":")
    assert uid.isdigit() and int(uid) >= 1000, "numeric uid so runAsNonRoot can verify it"
    pod = load_values(CHART / "values.yaml")["podSecurityContext"]
    assert (int(uid), int(gid)) == (pod["runAsUser"], pod["runAsGroup"])
    assert pod["runAsNonRoot"] is True


def test_installs_kvfleet_without_the_engine_extra(repo_root: Path, dockerfile: DockerfileParser) -> None:
    runs = " ".join(i["value"] for i in final_stage(dockerfile) if i["instruction"] == "RUN")
    # The kv-events extra (tokenizers, jinja2: the router's prompt tokenizer) and nothing heavier.
    assert 'pip install "$(echo /wheels/kvfleet-*.whl)[kv-events]"' in runs
    extra = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["kv-events"]
    assert sorted(d.split(">")[0] for d in extra) == ["jinja2", "tokenizers"]
    assert "[engine]" not in runs and "torch==" not in runs and "--index-url" not in runs
    # The build fails if torch arrives anyway (through a dependency), and drops the installer.
    assert "find_spec('torch') is None" in runs
    assert "pip uninstall -y -q pip setuptools wheel" in runs
    core = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in core if d.startswith(("torch", "safetensors", "tokenizers"))]


def test_entrypoint_takes_the_charts_arguments(dockerfile: DockerfileParser) -> None:
    (entrypoint,) = instructions(dockerfile, "ENTRYPOINT")
    # Exec form, so kvfleet is PID 1 and receives the kubelet's SIGTERM itself; the chart's
    # containers set only `args` (`operator run ...`), which follow this entrypoint.
    assert json.loads(entrypoint["value"]) == ["kvfleet"]
    exposed = {int(p) for i in instructions(dockerfile, "EXPOSE") for p in i["value"].split()}
    values = load_values(CHART / "values.yaml")
    assert {values[c]["port"] for c in ("operator", "router", "autoscaler")} <= exposed


def test_charts_image_is_the_one_the_dockerfile_documents(repo_root: Path) -> None:
    chart = load_values(CHART / "values.yaml")["image"]
    app_version = (CHART / "Chart.yaml").read_text().split('appVersion: "')[1].split('"')[0]
    text = (repo_root / "Dockerfile").read_text()
    assert f"docker build -t {chart['repository']}:{app_version} ." in text
    assert f"docker push {chart['repository']}:{app_version}" in text
    # No CI values file points the control plane at an engine image (those carry torch).
    for path in CI_VALUES:
        repository = load_values(path).get("image", {}).get("repository", chart["repository"])
        assert "engine" not in repository, f"{path.name}: {repository}"


def test_copy_sources_exist_and_context_is_trimmed(repo_root: Path, dockerfile: DockerfileParser) -> None:
    for copy in instructions(dockerfile, "COPY"):
        *sources, _dest = copy["value"].split()
        for source in sources:
            assert (repo_root / source).exists(), f"COPY {source} does not exist"
    # Every package folder the wheel needs is copied (pyproject's package-dir).
    copied = {c["value"].split()[0] for c in instructions(dockerfile, "COPY")}
    package_dirs = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(package_dirs.values()) <= copied
    ignore = (repo_root / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "docs"} <= set(ignore)
