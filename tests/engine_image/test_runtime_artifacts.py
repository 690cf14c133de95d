"""The reference engine's artifact: weights in runtime layout, saved once and reused, never
loaded for other weights or settings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from kvfleet.engine.artifacts_ready import READY_FILE
from kvfleet.engine.model import LlamaModel
from kvfleet.engine.model_config import load_model_config
from kvfleet.engine.runtime_artifacts import (
    META_FILE,
    RUNTIME_FILE,
    load_model,
    runtime_tensors,
    save_in_background,
    source_identity,
)
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine_image.engine_args import REFERENCE_ARTIFACTS_SUBDIR, artifacts_ready_marker

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=2, hidden=32, vocab=320, heads=4, kv_heads=2)


def save_sync(model: LlamaModel, directory: Path, identity: dict[str, object]) -> None:
    save_in_background(model, directory, identity).join(timeout=60)


def same_model(a: LlamaModel, b: LlamaModel) -> None:
    assert set(vars(a)) == set(vars(b)), "every attribute the forward pass reads must be restored"
    ta, tb = runtime_tensors(a), runtime_tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    assert (a.lm_head is a.embed) == (b.lm_head is b.embed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_miss_saves_then_hit_loads_the_same_model(tmp_path: Path, tiny: Path, dtype: torch.dtype) -> None:
    config = load_model_config(tiny)
    artifacts = tmp_path / "artifacts"
    first = load_model(config, tiny, CPU, dtype, artifacts)[0]
    # The save runs in the background; runtime.json, written last, says it finished.
    for _ in range(600):
        if (artifacts / META_FILE).exists():
            break
        time.sleep(0.05)
    assert (artifacts / RUNTIME_FILE).is_file()
    meta = json.loads((artifacts / META_FILE).read_text())
    assert meta == source_identity(tiny, dtype, CPU)
    second = load_model(config, tiny, CPU, dtype, artifacts)[0]
    same_model(first, second)
    assert second.layers[0].qkv_weight.dtype == dtype
    reference = LlamaModel(
        config, __import__("kvfleet.engine.weights", fromlist=["x"]).load_state_dict(tiny), CPU, dtype
    )
    same_model(reference, second)


def test_other_settings_or_weights_are_never_loaded(tmp_path: Path, tiny: Path) -> None:
    config = load_model_config(tiny)
    artifacts = tmp_path / "artifacts"
    model = load_model(config, tiny, CPU, torch.float32, None)[0]
    save_sync(model, artifacts, source_identity(tiny, torch.float32, CPU))
    # Poison the saved tensors: if they were loaded, the embedding would be all 7s.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(artifacts / RUNTIME_FILE))
    tensors["embed"] = torch.full_like(tensors["embed"], 7.0)
    save_file(tensors, str(artifacts / RUNTIME_FILE))
    same_identity = load_model(config, tiny, CPU, torch.float32, artifacts)[0]
    assert bool((same_identity.embed == 7.0).all())  # same identity: loaded
    rebuilt = load_model(config, tiny, CPU, torch.bfloat16, artifacts)[0]  # other dtype: rebuilt from weights
    assert not bool((rebuilt.embed == 7.0).all())


def test_unreadable_artifact_is_rebuilt(tmp_path: Path, tiny: Path) -> None:
    config = load_model_config(tiny)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / META_FILE).write_text(json.dumps(source_identity(tiny, torch.float32, CPU), sort_keys=True))
    (artifacts / RUNTIME_FILE).write_bytes(b"not safetensors")
    model = load_model(config, tiny, CPU, torch.float32, artifacts)[0]
    assert model.layers[0].qkv_weight.shape[0] > 0


def test_launcher_waits_for_the_engines_own_marker() -> None:
    assert artifacts_ready_marker("reference") == f"{REFERENCE_ARTIFACTS_SUBDIR}/{READY_FILE}"
    assert artifacts_ready_marker("vllm") is None  # vLLM's compile cache is complete when it is ready
