"""Device and dtype choice: pure functions of the settings and what the machine has."""

from __future__ import annotations

import torch

from kvfleet.engine.errors import DeviceUnavailableError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(choice: str, cuda_available: bool) -> torch.device:
    """``auto`` takes CUDA when present; ``cuda`` without a GPU is an error, not a silent CPU run."""
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or (choice == "auto" and cuda_available):
        if not cuda_available:
            raise DeviceUnavailableError("--device cuda: torch sees no CUDA device on this machine (try --device cpu)")
        return torch.device("cuda", 0)
    if choice == "auto":
        return torch.device("cpu")
    raise DeviceUnavailableError(f"device: unknown choice {choice!r} (auto, cpu or cuda)")


def resolve_dtype(choice: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """``auto``: float32 on CPU (half-precision matmuls are slow there); on CUDA the checkpoint's
    half dtype, or bfloat16 when the checkpoint is float32."""
    if choice != "auto":
        return _DTYPES[choice]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16
