"""Load Hugging Face weights from safetensors only (one file, or shards named by an index).
Pickled checkpoints (``.bin``, ``.pt``) are refused: unpickling runs arbitrary code."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvfleet.engine.errors import ModelLoadError
from kvfleet.weight_stream import StreamError, StreamReader

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

log = logging.getLogger(__name__)


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


def listed_weight_files(model_dir: Path, listed: tuple[str, ...]) -> list[Path]:
    """The safetensors files of a folder still being filled (kvfleet.weight_stream), from its file
    list: the same choice as ``weight_files``, made before the shards are there. The index, a small
    file, must be there already (the caller waits for the small files first)."""
    if SINGLE_FILE in listed:
        return [model_dir / SINGLE_FILE]
    if INDEX_FILE in listed:
        names = _shard_names(model_dir)
        missing = [name for name in names if name not in listed]
        if missing:
            raise ModelLoadError(
                f"{model_dir}: shards named in {INDEX_FILE} are not among the model's files: {missing}"
            )
        return [model_dir / name for name in names]
    raise ModelLoadError(f"{model_dir}: the model's files hold no {SINGLE_FILE} or {INDEX_FILE}")


def load_state_dict(model_dir: Path, arrivals: StreamReader | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the model. With ``arrivals`` (a folder the weight pull is still filling),
    each shard is read as soon as it is in place and verified, while later shards still download."""
    state: dict[str, torch.Tensor] = {}
    files = weight_files(model_dir) if arrivals is None else listed_weight_files(model_dir, arrivals.files())
    for path in files:
        waited = time.monotonic()
        if arrivals is not None:
            try:
                arrivals.wait_for(path.name)
            except StreamError as e:
                raise ModelLoadError(str(e)) from e
        waited = time.monotonic() - waited
        try:
            tensors = load_file(str(path), device="cpu")
        except (OSError, SafetensorError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors: {e}") from e
        state.update(tensors)
        log.info("loaded %s: %d tensors (waited %.2f s for it)", path.name, len(tensors), waited)
    return state
