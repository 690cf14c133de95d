"""Engine artifacts of the reference engine: the weights in runtime layout.

Loading a Hugging Face checkpoint means fusing q/k/v and gate/up and converting to the serving
dtype, a full pass over the weights on every start. With ``--artifacts-dir`` and
``--runtime-weights-artifact`` the engine saves the result (safetensors, never pickle) once it is
serving, and a later start with the same directory loads the runtime tensors directly. Off by
default: the copy is as large as the weights and saves only the fuse pass (docs/engine_image.md);
the artifact that pays is the compile cache (``compile_cache.py``).

The directory carries ``runtime.json``, written last, naming what the tensors were built from
(config.json's sha256, the weight files' names and sizes, dtype, device type): anything else is
not loaded, it is rebuilt. The launcher keys whole directories by a fingerprint too; this check
keeps a hand-passed ``--artifacts-dir`` just as safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.forward_pieces import EagerPieces
from kvfleet.engine.model import Layer, LlamaModel
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.weights import load_state_dict, weight_files
from kvfleet.weight_stream import StreamReader

log = logging.getLogger(__name__)

RUNTIME_FILE = "runtime.safetensors"
META_FILE = "runtime.json"
FORMAT = 1
_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(Layer))


def source_identity(model_dir: Path, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """What runtime tensors are valid for: cheap to compute (one small file hashed, the rest stat'ed)."""
    config_sha = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    files = [[p.name, p.stat().st_size] for p in weight_files(model_dir)]
    return {"format": FORMAT, "configSha256": config_sha, "weights": files, "dtype": str(dtype), "device": device.type}


def runtime_tensors(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Every tensor the forward pass uses, by a stable name; a tied lm_head is stored once."""
    out = {"embed": model.embed, "norm": model.norm, "cos": model.cos, "sin": model.sin}
    if model.lm_head is not model.embed:
        out["lm_head"] = model.lm_head
    for i, layer in enumerate(model.layers):
        for name in _LAYER_FIELDS:
            value = getattr(layer, name)
            if value is not None:
                out[f"layers.{i}.{name}"] = value
    return out


def model_from_runtime(
    config: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> LlamaModel:
    """A :class:`LlamaModel` from runtime tensors, skipping the fuse-and-convert pass."""
    try:
        model = LlamaModel.__new__(LlamaModel)
        model.config, model.device, model.dtype = config, device, dtype
        model.embed, model.norm = tensors["embed"], tensors["norm"]
        model.cos, model.sin = tensors["cos"], tensors["sin"]
        model.lm_head = tensors.get("lm_head", model.embed)
        model.pieces = EagerPieces(config)
        model.decode_attention_triton = False  # as LlamaModel.__init__; the engine sets it from its settings
        model.layers = [
            Layer(**{name: tensors.get(f"layers.{i}.{name}") for name in _LAYER_FIELDS})  # type: ignore[arg-type]
            for i in range(config.num_hidden_layers)
        ]
    except KeyError as e:
        raise ModelLoadError(f"runtime artifact lacks tensor {e}") from e
    if any(layer.qkv_weight is None for layer in model.layers):
        raise ModelLoadError("runtime artifact lacks layer tensors")
    return model


def _save(model: LlamaModel, directory: Path, identity: dict[str, Any]) -> None:
    # Temp names then renames, metadata last: a crash mid-save leaves no runtime.json, so nothing
    # half-written is ever loaded.
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-{os.getpid()}-{RUNTIME_FILE}"
    tensors = {k: v.detach().contiguous().cpu() for k, v in runtime_tensors(model).items()}
    save_file(tensors, str(tmp), metadata={"kvfleet": json.dumps(identity)})
    os.replace(tmp, directory / RUNTIME_FILE)
    meta_tmp = directory / f".tmp-{os.getpid()}-{META_FILE}"
    meta_tmp.write_text(json.dumps(identity, sort_keys=True))
    os.replace(meta_tmp, directory / META_FILE)


def save_in_background(model: LlamaModel, directory: Path, identity: dict[str, Any]) -> threading.Thread:
    """Save after loading without delaying readiness; a daemon thread, so it never blocks exit."""

    def run() -> None:
        try:
            _save(model, directory, identity)
            log.info("runtime artifact saved to %s", directory)
        except (OSError, SafetensorError, RuntimeError) as e:
            log.warning("runtime artifact not saved to %s: %s", directory, e)

    thread = threading.Thread(target=run, name="runtime-artifact-save", daemon=True)
    thread.start()
    return thread


def _load(directory: Path, identity: dict[str, Any], config: ModelConfig, device: torch.device) -> LlamaModel | None:
    try:
        stored = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        return None  # no artifact yet (or a save that never finished)
    if stored != identity:
        log.warning("runtime artifact in %s was built from other weights or settings; rebuilding", directory)
        return None
    try:
        tensors = load_file(str(directory / RUNTIME_FILE), device=str(device))
        dtype = tensors["embed"].dtype
        return model_from_runtime(config, tensors, device, dtype)
    except (OSError, SafetensorError, KeyError, ModelLoadError) as e:
        log.warning("runtime artifact in %s is unreadable (%s); rebuilding", directory, e)
        return None


def load_model(
    config: ModelConfig,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    artifacts_dir: Path | None,
    arrivals: StreamReader | None = None,
) -> tuple[LlamaModel, threading.Thread | None]:
    """Load from runtime artifacts when valid ones exist; otherwise from the checkpoint, then save
    them (the thread doing so is returned, None when nothing is being saved). ``arrivals``: the
    checkpoint's folder is still being filled by the pull (kvfleet.weight_stream)."""
    if artifacts_dir is None:
        return LlamaModel(config, load_state_dict(model_dir, arrivals), device, dtype), None
    identity = source_identity(model_dir, dtype, device)
    model = _load(artifacts_dir, identity, config, device)
    if model is not None:
        log.info("loaded runtime artifact from %s", artifacts_dir)
        return model, None
    model = LlamaModel(config, load_state_dict(model_dir, arrivals), device, dtype)
    return model, save_in_background(model, artifacts_dir, identity)
