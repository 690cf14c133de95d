"""Engine-artifact fingerprints: everything that makes a compile cache or CUDA-graph build valid.
Two environments share artifacts only when every field matches; the key is the sha256 of the
canonical JSON of the fields, so a new field or a changed value is a different key (a clean miss)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

FINGERPRINT_SCHEMA = "kvfleet.io/artifact-fingerprint/v1"

# vLLM flags that change what torch.compile and CUDA-graph capture produce. Flags that only change
# runtime behaviour (ports, logging, memory fraction) are left out so they do not split the cache.
COMPILE_FLAGS = frozenset(
    {
        "--max-model-len",
        "--kv-cache-dtype",
        "--quantization",
        "-q",
        "--enforce-eager",
        "--compilation-config",
        "-O",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--block-size",
        "--cuda-graph-sizes",
        "--max-seq-len-to-capture",
        "--enable-lora",
        "--max-lora-rank",
        "--speculative-config",
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--enable-expert-parallel",
        "--attention-backend",
        "--override-generation-config",
        "--hf-overrides",
        # The reference engine's compile flags (its --block-size, --max-num-seqs and
        # --max-num-batched-tokens share vLLM's names above).
        "--compile",
        "--compile-mode",
        "--compile-sizes",
        "--runtime-weights-artifact",
        "--no-runtime-weights-artifact",
    }
)


def compile_relevant_args(args: Sequence[str]) -> tuple[str, ...]:
    """The compile-relevant flags of an engine command line, normalised to ``--flag=value`` and
    sorted, so ``--max-model-len 4096`` and ``--max-model-len=4096`` give one fingerprint."""
    found: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-O") and len(arg) > 2 and arg[2] != "=":
            arg = f"-O={arg[2:]}"  # vLLM's -O3 is -O 3
        flag, eq, value = arg.partition("=")
        if flag in COMPILE_FLAGS:
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                value, i = args[i + 1], i + 1
                eq = "="
            found.append(f"{flag}={value}" if eq else flag)
        i += 1
    return tuple(sorted(found))


class Fingerprint(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    schema_: str = Field(default=FINGERPRINT_SCHEMA, alias="schema")
    engine_name: str = Field(min_length=1, max_length=64)
    engine_version: str = Field(min_length=1, max_length=128)
    model_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    gpu_product: str = Field(min_length=1, max_length=128)
    cuda_version: str | None = Field(default=None, max_length=32)
    driver_version: str | None = Field(default=None, max_length=64)
    # The compute capability (sm_90) on CUDA, the vector ISA (AVX2, AVX512) on CPU: compiled
    # kernels are specialised to it.
    device_capability: str | None = Field(default=None, max_length=32)
    # torch.compile's output depends on torch's version even where the engine's does not change.
    torch_version: str | None = Field(default=None, max_length=64)
    tensor_parallel_size: int = Field(ge=1, le=64)
    dtype: str = Field(min_length=1, max_length=32)
    compile_flags: tuple[str, ...] = Field(default=(), max_length=256)

    @property
    def key(self) -> str:
        wire = self.model_dump(mode="json", by_alias=True)
        return hashlib.sha256(json.dumps(wire, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


@dataclass(frozen=True)
class Accelerator:
    gpu_product: str  # "cpu" when no CUDA device is visible
    cuda_version: str | None
    driver_version: str | None
    device_count: int
    capability: str | None = None  # sm_XY on CUDA; the CPU's vector ISA (cpu_capability) on CPU


def cpu_capability(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The vector ISA Inductor's C++ kernels are built for, read from the CPU flags (no torch
    import; the same levels as ``torch.backends.cpu.get_cpu_capability``)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512"
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return "DEFAULT"


class _Cuda(Protocol):
    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def get_device_name(self, device: int) -> str: ...


class _Torch(Protocol):
    @property
    def cuda(self) -> _Cuda: ...
    @property
    def version(self) -> Any: ...


_DRIVER = re.compile(r"Kernel Module(?: for [^ ]+)?\s+([0-9][0-9.]*)")


def read_driver_version(path: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    try:
        match = _DRIVER.search(path.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def detect_accelerator(torch_module: _Torch | None = None, driver_file: Path | None = None) -> Accelerator:
    """What device the engine will compile for: CUDA device 0's product, CUDA and driver versions,
    or ``cpu`` where torch sees no CUDA device."""
    if torch_module is None:
        import torch

        module: _Torch = torch  # type: ignore[assignment]
    else:
        module = torch_module
    cuda = module.cuda
    if not cuda.is_available():
        return Accelerator(gpu_product="cpu", cuda_version=None, driver_version=None, device_count=0)
    capability = None
    if hasattr(cuda, "get_device_capability"):
        major, minor = cuda.get_device_capability(0)
        capability = f"sm_{major}{minor}"
    return Accelerator(
        gpu_product=cuda.get_device_name(0).replace(" ", "-"),
        cuda_version=getattr(module.version, "cuda", None),
        driver_version=read_driver_version(driver_file) if driver_file else read_driver_version(),
        device_count=cuda.device_count(),
        capability=capability,
    )


def fingerprint(
    *,
    engine_name: str,
    engine_version: str,
    model_digest: str,
    accelerator: Accelerator,
    tensor_parallel_size: int,
    dtype: str,
    engine_args: Sequence[str] = (),
    torch_version: str | None = None,
) -> Fingerprint:
    return Fingerprint(
        engine_name=engine_name,
        engine_version=engine_version,
        model_digest=model_digest,
        gpu_product=accelerator.gpu_product,
        cuda_version=accelerator.cuda_version,
        driver_version=accelerator.driver_version,
        device_capability=accelerator.capability,
        torch_version=torch_version,
        tensor_parallel_size=tensor_parallel_size,
        dtype=dtype,
        compile_flags=compile_relevant_args(engine_args),
    )
