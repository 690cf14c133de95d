"""The model loads Hugging Face layouts and matches transformers' logits: RoPE scaling, Qwen2
biases, tied embeddings, sharded safetensors; bad folders are refused with clear messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.model import LlamaModel
from kvfleet.engine.paged_attention import ForwardBatch, prefill_group, slot_table
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.weights import load_state_dict

CPU = torch.device("cpu")


def paged_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = LlamaModel.from_pretrained(model_dir, CPU, torch.float32)
    k, v = model.allocate_kv_pools(64 * 4)
    table = list(range(63, 63 - (len(ids) + 3) // 4, -1))  # scattered, descending blocks
    slots = slot_table([table], 4)[0]
    batch = ForwardBatch(
        token_ids=torch.tensor(ids),
        positions=torch.arange(len(ids)),
        slot_mapping=slots[: len(ids)],
        groups=(prefill_group(slice(0, len(ids)), slots, 0, CPU),),
        logits_rows=torch.arange(len(ids)),
    )
    return model.forward(batch, k, v)


def hf_logits(model_dir: Path, ids: list[int], cls_name: str = "LlamaForCausalLM") -> torch.Tensor:
    import transformers

    hf = getattr(transformers, cls_name).from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids]), use_cache=False).logits[0]


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


IDS = [(i * 37) % 500 + 5 for i in range(90)]


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", layers=1, hidden=64, vocab=512)
    edit_config(
        model,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500000.0,
    )
    ours, theirs = paged_logits(model, IDS), hf_logits(model, IDS)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_linear_rope_and_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", layers=1, hidden=64, vocab=512, tie_word_embeddings=True)
    edit_config(model, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert "lm_head.weight" not in load_file(str(model / "model.safetensors"))
    ours, theirs = paged_logits(model, IDS), hf_logits(model, IDS)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_qwen2_biases_match_transformers(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", layers=2, hidden=64, vocab=512)
    state = load_file(str(model / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for i in range(2):
        for name in ("q", "k", "v"):
            weight = state[f"model.layers.{i}.self_attn.{name}_proj.weight"]
            state[f"model.layers.{i}.self_attn.{name}_proj.bias"] = torch.randn(weight.shape[0], generator=gen)
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    edit_config(model, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    ours, theirs = paged_logits(model, IDS), hf_logits(model, IDS, "Qwen2ForCausalLM")
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_sharded_safetensors_load_like_one_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded)
    state = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(sharded / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_state_dict(sharded)
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[k], state[k]) for k in names)


def test_bad_folders_are_refused_clearly(tmp_path: Path, tiny_model_dir: Path) -> None:
    escape = tmp_path / "escape"
    shutil.copytree(tiny_model_dir, escape)
    (escape / "model.safetensors").unlink()
    (escape / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"plain \.safetensors file name"):
        load_state_dict(escape)

    arch = tmp_path / "arch"
    shutil.copytree(tiny_model_dir, arch)
    edit_config(arch, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LlamaModel.from_pretrained(arch, CPU, torch.float32)

    rope = tmp_path / "rope"
    shutil.copytree(tiny_model_dir, rope)
    edit_config(rope, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="yarn"):
        LlamaModel.from_pretrained(rope, CPU, torch.float32)

    missing = tmp_path / "missing"
    shutil.copytree(tiny_model_dir, missing)
    state = load_file(str(missing / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(missing / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj"):
        LlamaModel.from_pretrained(missing, CPU, torch.float32)
