"""Engine artifacts: what makes them valid (the fingerprint inputs) and where the engine finds them.

An artifact built for one engine version, model, GPU or flag set is never loaded by another: the
fingerprint covers everything that changes the compiled result (ARCHITECTURE.md). The inputs are
computed by a pure function from the spec and a probe of this machine, so tests can check that a
change in any of them changes the fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvfleet.spec import InferenceDeploymentSpec

# The distribution whose version identifies each engine kind's compiled code.
ENGINE_DISTRIBUTIONS = {"vllm": "vllm", "sglang": "sglang", "reference": "kvfleet"}
# Bounded wait for nvidia-smi, which can hang on a wedged driver.
NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Accelerator:
    """What this machine runs the engine on, as far as compiled kernels care."""

    device: str  # "cpu" or "cuda"
    product: str = ""  # e.g. "NVIDIA H100 80GB HBM3"
    driver: str = ""
    torch_version: str = ""


def distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


def probe_accelerator(want_gpu: bool) -> Accelerator:
    """Ask nvidia-smi for the GPU product and driver (cheap: no torch or CUDA import)."""
    torch_version = distribution_version("torch")
    if not want_gpu:
        return Accelerator(device="cpu", torch_version=torch_version)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Accelerator(device="cuda", product="unknown", driver="unknown", torch_version=torch_version)
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return Accelerator(device="cuda", product="unknown", driver="unknown", torch_version=torch_version)
    first = out.strip().splitlines()[0] if out.strip() else ","
    product, _, driver = first.partition(",")
    return Accelerator(device="cuda", product=product.strip(), driver=driver.strip(), torch_version=torch_version)


def fingerprint_inputs(
    spec: InferenceDeploymentSpec, model_digest: str, engine_version: str, accelerator: Accelerator
) -> dict[str, str]:
    """Everything that makes a compiled artifact valid, as strings (stable JSON)."""
    engine = spec.engine
    return {
        "engineKind": engine.kind,
        "engineVersion": engine_version,
        "modelDigest": model_digest,
        "device": accelerator.device,
        "gpuProduct": accelerator.product,
        "driver": accelerator.driver,
        "torch": accelerator.torch_version,
        "tensorParallelSize": str(engine.tensor_parallel_size),
        "dtype": engine.dtype,
        "kvCacheDtype": engine.kv_cache_dtype,
        "quantization": engine.quantization or "",
        "maxModelLen": str(engine.max_model_len or ""),
        # Extra args can change compilation (e.g. --compilation-config); order matters to engines.
        "extraArgs": json.dumps(engine.extra_args),
    }


def fingerprint_of(inputs: Mapping[str, str]) -> str:
    """The artifact key: sha256 of the canonical JSON of the inputs."""
    canonical = json.dumps(dict(inputs), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# Written into an artifacts directory once it is known complete (fetched, or pushed after a
# miss), so the next launch on this node uses it without asking the bucket.
COMPLETE_MARKER = ".kvfleet-complete"


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


def mark_complete(directory: Path) -> None:
    (directory / COMPLETE_MARKER).write_text("ok\n")
