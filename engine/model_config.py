"""The parts of a Hugging Face ``config.json`` the Llama-family model needs, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.engine.errors import ModelLoadError

# Architectures that share the Llama decoder layout (Qwen2 adds q/k/v biases, Mistral is Llama
# without sliding window here).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in float32 bytes (the pool scales by dtype)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(merged.get("rope_type", merged.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    architectures = raw.get("architectures") or ["LlamaForCausalLM"]
    architecture = str(architectures[0])
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"config.json: architecture {architecture!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = raw.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim % 2:
        raise ModelLoadError(f"config.json: head_dim must be an even integer, got {head_dim!r}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    theta, scaling = _rope(raw)
    return ModelConfig(
        architecture=architecture,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", architecture == "Qwen2ForCausalLM")),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "float32"))),
    )


def load_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return parse_model_config(raw)
