"""Load Hugging Face weights from safetensors only (one file, or shards named by an index).
Pickled checkpoints (``.bin``, ``.pt``) are refused: unpickling runs arbitrary code."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvfleet.engine.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _shard_names(model_dir: Path) -> list[str]:
    index_path = model_dir / INDEX_FILE
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index_path}: not a valid safetensors index: {e}") from e
    names = sorted(set(weight_map.values()))
    for name in names:
        # Shard names come from a file we did not write: keep them inside the model folder.
        if (
            not isinstance(name, str)
            or "/" in name
            or "\\" in name
            or name.startswith(".")
            or not name.endswith(".safetensors")
        ):
            raise ModelLoadError(f"{index_path}: shard name {name!r} is not a plain .safetensors file name")
    return names


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder, or a clear error naming what was found instead."""
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    if (model_dir / INDEX_FILE).is_file():
        files = [model_dir / name for name in _shard_names(model_dir)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards named in {INDEX_FILE} are missing: {missing}")
        return files
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise ModelLoadError(
            f"{model_dir}: only pickled checkpoints found ({', '.join(pickled)}); kvfleet loads safetensors only "
            "because unpickling can run arbitrary code. Convert the checkpoint to safetensors first."
        )
    raise ModelLoadError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            state.update(load_file(str(path), device="cpu"))
        except (OSError, SafetensorError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors: {e}") from e
    return state
