"""Images for the real node, with no registry: built with buildah (vfs storage in a cache folder
of its own, never the host's /var/lib/containers), written as docker-archive tarballs cached by
a hash of their inputs, and imported into the node's containerd (``ctr -n k8s.io images import``).
Pods use them with ``imagePullPolicy: Never``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import NodeError

IMAGE_TIMEOUT_S = 1800.0  # a CPU engine image with torch: minutes on 2 cores


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("KVFLEET_IMAGE_CACHE", Path(base) / "kvfleet" / "images"))


def buildah_argv(store: Path) -> list[str]:
    return ["buildah", "--root", str(store / "root"), "--runroot", str(store / "run"), "--storage-driver", "vfs"]


def _run(argv: list[str], what: str, timeout_s: float = IMAGE_TIMEOUT_S) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise NodeError(f"{what}: {' '.join(argv[:6])} ... failed: {result.stderr.strip()[-800:]}")
    return result.stdout.strip()


def files_image(name: str, files: dict[str, Path], entrypoint: list[str]) -> Path:
    """An image of just ``files`` (image path -> file here), as a cached docker-archive tarball."""
    # Content, not where it came from: the same binary from another folder is the same image.
    digest = hashlib.sha256(json.dumps([name, entrypoint, sorted(files)]).encode())
    for dest in sorted(files):
        digest.update(files[dest].read_bytes())
    out = cache_dir() / f"{name.replace('/', '_').replace(':', '_')}-{digest.hexdigest()[:16]}.tar"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    b = buildah_argv(cache_dir() / "buildah")
    container = _run([*b, "from", "scratch"], f"image {name}")
    try:
        for dest, source in files.items():
            _run([*b, "copy", "--chmod", "0755", container, str(source), dest], f"image {name}")
        _run([*b, "config", "--entrypoint", json.dumps(entrypoint), container], f"image {name}")
        _run([*b, "commit", "-q", container, name], f"image {name}")
    finally:
        subprocess.run([*b, "rm", container], capture_output=True, check=False)
    tmp = out.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    _run([*b, "push", name, f"docker-archive:{tmp}:{name}"], f"image {name}")
    tmp.replace(out)
    return out


def import_image(socket: Path, tarball: Path) -> None:
    """Load ``tarball`` into the node's containerd, where the kubelet's CRI finds it."""
    _run(["ctr", "--address", str(socket), "-n", "k8s.io", "images", "import", str(tarball)], f"import {tarball.name}")


def node_images(socket: Path) -> list[str]:
    out = _run(["ctr", "--address", str(socket), "-n", "k8s.io", "images", "list", "-q"], "list images", 60)
    return out.splitlines()


def load_repo_image(socket: Path, name: str, tarball: Path) -> bool:
    """Import ``name`` (``kvfleet.local/IMAGE:<input hash>``) unless the node's store has it (the
    store outlives clusters: see ``node_store``), then drop the store's other tags of the image so
    it holds one build of each. True when it was imported."""
    present = node_images(socket)
    loaded = name not in present
    if loaded:
        import_image(socket, tarball)
    repository = name.rsplit(":", 1)[0]
    old = [ref for ref in present if ref.rsplit(":", 1)[0] == repository and ref != name]
    if old:
        # containerd's garbage collector then frees their layers (those still used stay).
        _run(["ctr", "--address", str(socket), "-n", "k8s.io", "images", "rm", *old], "remove old images", 120)
    return loaded


def node_store() -> Path:
    """containerd's root (content and unpacked snapshots) kept across real-node clusters in the
    image cache, so a warm `up` finds the engine image (GBs) already imported; never the host's
    /var/lib. One cluster at a time holds it (a lock its containerd keeps open); another cluster
    meanwhile gets a store of its own."""
    return cache_dir() / "node-containerd"


# --- the repository's own images, from its Dockerfiles as committed -------------------------------

# The Dockerfiles' python:3.11 base, made from Debian packages (no registry): Debian's Python 3.11
# with pip; pip may install into it (a container's own Python, so Debian's "externally managed"
# marker goes) and `python`/`pip` are on PATH as the Dockerfiles call them.
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-pip", "python-is-python3", "passwd", "ca-certificates")
BASE_NAME = "kvfleet.local/python-base"
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# What the Dockerfiles COPY: a change to any of these (or to the Dockerfile) makes a new image.
SOURCES = (
    "pyproject.toml",
    "README.md",
    "kvfleet",
    "operator",
    "autoscaler",
    "router",
    "weight_cache",
    "engine",
    "engine_image",
)


@dataclass(frozen=True)
class RepoImage:
    name: str  # kvfleet.local/<name>; the tag is a hash of the inputs
    dockerfile: str  # relative to the repository root
    build_args: tuple[tuple[str, str], ...] = ()


def _hash_tree(repo: Path, parts: tuple[str, ...], digest: Any) -> None:
    for part in parts:
        path = repo / part
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            digest.update(str(f.relative_to(repo)).encode())
            digest.update(f.read_bytes())


def base_image(mirror: str, log: Callable[[str], None]) -> str:
    """``kvfleet.local/python-base:<hash>`` in buildah's store, made with mmdebstrap once."""
    key = hashlib.sha256(json.dumps([BASE_SUITE, BASE_PACKAGES, mirror, "v1"]).encode()).hexdigest()[:12]
    name = f"{BASE_NAME}:{key}"
    b = buildah_argv(cache_dir() / "buildah")
    if subprocess.run([*b, "inspect", "--type", "image", name], capture_output=True, check=False).returncode == 0:
        return name
    rootfs = cache_dir() / f"python-base-{key}.tar"
    if not rootfs.exists():
        log(f"base: mmdebstrap {BASE_SUITE} ({', '.join(BASE_PACKAGES)}) ...")
        tmp = rootfs.with_suffix(".tmp.tar")
        _run(
            [
                "mmdebstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
                '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
                BASE_SUITE,
                str(tmp),
                mirror,
            ],
            "mmdebstrap",
        )
        tmp.replace(rootfs)
    container = _run([*b, "from", "scratch"], "base image")
    try:
        _run([*b, "add", container, str(rootfs), "/"], "base image")
        _run(
            [
                *b,
                "config",
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--cmd",
                "python3",
                container,
            ],
            "base image",
        )
        _run([*b, "commit", "-q", container, name], "base image")
    finally:
        subprocess.run([*b, "rm", container], capture_output=True, check=False)
    return name


# The engine image's heavy part, torch (GBs from the registry) and the package's dependencies,
# installed once into a base of its own keyed by their pins: the engine Dockerfile, built as
# committed on it, finds them satisfied and adds only kvfleet, so a source change rebuilds in
# minutes instead of a quarter of an hour. pip's downloads are kept in the image cache (for this
# step only) so a new pin downloads only what changed.
ENGINE_BASE_NAME = "kvfleet.local/engine-base"


def engine_requirements(repo: Path) -> list[str]:
    """The dependencies the engine image's ``pip install "/src[engine]"`` asks for, torch excluded
    (its own step installs it from TORCH_INDEX)."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["engine"]]
    return [r for r in reqs if not re.match(r"torch\b", r)]


# Packages of the running environment never pinned into the engine base: kvfleet itself (the
# Dockerfile installs it) and torch with its CUDA companions (TORCH_INDEX's build decides them).
_UNPINNED = re.compile(r"^(kvfleet.*|torch|triton|nvidia-.*|cuda-.*|pip|setuptools|wheel)$")


def pinned_constraints() -> str:
    """pip constraints: every package of the environment this runs in (the one the tests pass
    with) at its installed version. Without them pip's resolver backtracked through hundreds of
    boto3/botocore releases for 20 minutes in the image build; with them it resolves at once."""
    from importlib.metadata import distributions

    pins = set()
    for dist in distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if name and not _UNPINNED.match(name):
            pins.add(f"{name}=={dist.version}")
    return "\n".join(sorted(pins)) + "\n"


def dockerfile_arg(dockerfile: Path, name: str) -> str:
    """An ``ARG NAME=default`` line's default in ``dockerfile``."""
    m = re.search(rf"^ARG {name}=(\S+)\s*$", dockerfile.read_text(), re.M)
    if m is None:
        raise NodeError(f"{dockerfile}: no default for ARG {name}")
    return m.group(1)


def engine_base_image(repo: Path, base: str, torch_index: str, log: Callable[[str], None]) -> str:
    """``kvfleet.local/engine-base:<hash>`` in buildah's store: ``base`` with the engine
    Dockerfile's torch pin (from ``torch_index``) and the engine's dependencies installed."""
    torch = dockerfile_arg(repo / "engine_image" / "Dockerfile.cpu", "TORCH_VERSION")
    reqs = engine_requirements(repo)
    constraints = pinned_constraints()
    key = hashlib.sha256(json.dumps([base, torch, torch_index, reqs, constraints, "v1"]).encode()).hexdigest()[:12]
    name = f"{ENGINE_BASE_NAME}:{key}"
    b = buildah_argv(cache_dir() / "buildah")
    if subprocess.run([*b, "inspect", "--type", "image", name], capture_output=True, check=False).returncode == 0:
        return name
    pip_cache = cache_dir() / "pip"
    pip_cache.mkdir(parents=True, exist_ok=True)
    pins = cache_dir() / f"engine-base-constraints-{key}.txt"
    pins.write_text(constraints)
    mounts = ["--volume", f"{pip_cache}:/root/.cache/pip", "--volume", f"{pins}:/etc/kvfleet-pip-constraints.txt:ro"]
    if Path(HOST_CA_BUNDLE).exists():
        mounts += ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    container = _run([*b, "from", "--pull-never", base], "engine base")
    try:
        run = [*b, "run", "--isolation=chroot", *mounts, container, "--", "pip", "install", "--no-warn-script-location"]
        log(f"engine base: torch=={torch} from {torch_index} ...")
        _run([*run, "--index-url", torch_index, f"torch=={torch}"], "engine base (torch)")
        log(f"engine base: {len(reqs)} dependencies ...")
        _run([*run, "-c", "/etc/kvfleet-pip-constraints.txt", *reqs], "engine base (dependencies)")
        _run([*b, "commit", "-q", container, name], "engine base")
    finally:
        subprocess.run([*b, "rm", container], capture_output=True, check=False)
    for old in _list_images(b, ENGINE_BASE_NAME):
        if old != name:
            subprocess.run([*b, "rmi", old], capture_output=True, check=False)
    return name


def _list_images(b: list[str], repo_name: str) -> list[str]:
    out = subprocess.run(
        [*b, "images", "--format", "{{.Name}}:{{.Tag}}", repo_name], capture_output=True, text=True, check=False
    )
    return [line for line in out.stdout.splitlines() if line.startswith(repo_name + ":")]


def repo_image(repo: Path, image: RepoImage, base: str, log: Callable[[str], None]) -> tuple[str, Path]:
    """Build ``image`` from the repository's Dockerfile with the local base; returns its name and
    its cached docker-archive tarball (a warm run returns the tarball without building)."""
    digest = hashlib.sha256(json.dumps([image.name, image.dockerfile, list(image.build_args), base]).encode())
    _hash_tree(repo, (image.dockerfile, f"{image.dockerfile}.dockerignore", *SOURCES), digest)
    name = f"kvfleet.local/{image.name}:{digest.hexdigest()[:12]}"
    out = cache_dir() / f"{image.name}-{digest.hexdigest()[:12]}.tar"
    if out.exists():
        return name, out
    b = buildah_argv(cache_dir() / "buildah")
    args = [a for k, v in (("PYTHON_IMAGE", base), *image.build_args) for a in ("--build-arg", f"{k}={v}")]
    log(f"{image.name}: buildah bud -f {image.dockerfile} ...")
    _run(
        [
            *b,
            "bud",
            "--isolation=chroot",  # no user namespace or runc inside the build: this machine's sandbox
            "--pull-never",  # the base is local; nothing comes from a registry
            "--layers=false",
            # The build's RUN steps trust the CAs this machine trusts (an egress proxy's included),
            # mounted for the build only: nothing of it lands in the image.
            *(["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"] if Path(HOST_CA_BUNDLE).exists() else []),
            "-f",
            str(repo / image.dockerfile),
            "--ignorefile",
            str(repo / f"{image.dockerfile}.dockerignore"),
            *args,
            "-t",
            name,
            str(repo),
        ],
        f"build {image.name}",
    )
    tmp = out.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    _run([*b, "push", name, f"docker-archive:{tmp}:{name}"], f"export {image.name}")
    tmp.replace(out)
    # The tarball is the cache: the built image's own copy in buildah's store (vfs: a full copy of
    # every layer, GBs for the engine) goes.
    subprocess.run([*b, "rmi", name], capture_output=True, check=False)
    _prune(b, image.name, keep=out)
    return name, out


def _prune(b: list[str], image_name: str, keep: Path) -> None:
    """Bound the cache: one build of each image (older tags and their tarballs go, with the
    intermediate images a build leaves)."""
    for old in cache_dir().glob(f"{image_name}-*.tar"):
        if old != keep:
            tag = old.stem.removeprefix(f"{image_name}-")
            subprocess.run([*b, "rmi", f"kvfleet.local/{image_name}:{tag}"], capture_output=True, check=False)
            old.unlink(missing_ok=True)
    subprocess.run([*b, "rmi", "--prune"], capture_output=True, check=False)


# The repository root (the Dockerfiles' build context) of this source checkout.
BUILD_CONTEXT = Path(__file__).resolve().parents[3]
