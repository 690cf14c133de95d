"""Device selection: auto takes CUDA when present; asking for CUDA without one is a clear error.
The CUDA run itself is a `gpu` test (skipped with its reason where no GPU is visible)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.device import resolve_device, resolve_dtype
from kvfleet.engine.errors import DeviceUnavailableError
from kvfleet.engine.sampling import SamplingParams

from .conftest import make_core, run_to_completion


def test_auto_picks_cuda_only_when_present() -> None:
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda", 0)
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        resolve_device("cuda", cuda_available=False)


def test_dtype_defaults() -> None:
    assert resolve_dtype("auto", torch.device("cpu"), "bfloat16") is torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0), "float16") is torch.float16
    assert resolve_dtype("auto", torch.device("cuda", 0), "float32") is torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu"), "float32") is torch.float16


@pytest.mark.gpu
def test_cuda_engine_matches_cpu_engine(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": list(range(10 + i, 40 + 3 * i)) for i in range(4)}
    cpu = run_to_completion(make_core(tiny_model_dir, device="cpu"), prompts, params)
    gpu = run_to_completion(make_core(tiny_model_dir, device="cuda", dtype="float32"), prompts, params)
    assert gpu == cpu
