"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Weights load from Hugging Face layout; q/k/v and gate/up projections are fused at load time so a
layer runs four matmuls. RMSNorm, RoPE (default, linear and llama3 scaling), grouped-query
attention and SwiGLU follow transformers' Llama so the same checkpoint gives the same logits.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvfleet.engine.block_table_attention import UniformBatch, block_table_attention, causal_mask
from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.forward_pieces import EagerPieces, ForwardPieces
from kvfleet.engine.model_config import ModelConfig, RopeScaling, load_model_config
from kvfleet.engine.paged_attention import ForwardBatch, paged_attention
from kvfleet.engine.paged_decode_triton import paged_decode_attention
from kvfleet.engine.weights import load_state_dict

# SDPA backends the engine lets torch choose from: cuDNN's is left out because it builds a new plan
# for every new shape (measured: 86% of a decode step's host time on an H200, torch 2.11).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


class LlamaModel:
    """Inference-only weights and forward; the KV pools are owned by the caller."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ModelLoadError(f"weights: tensor {name!r} is missing")
            return state.pop(name).to(device=device, dtype=dtype)

        c = config
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.embed = take("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise ModelLoadError(
                f"weights: embed_tokens has shape {tuple(self.embed.shape)}, config says "
                f"({c.vocab_size}, {c.hidden_size})"
            )
        self.layers: list[Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(f"{p}self_attn.{n}_proj.weight") for n in ("q", "k", "v"))
            if q.shape != (q_dim, c.hidden_size) or k.shape != (kv_dim, c.hidden_size) or v.shape != k.shape:
                raise ModelLoadError(f"weights: layer {i} q/k/v shapes do not match config.json")
            bias = None
            if f"{p}self_attn.q_proj.bias" in state:
                bias = torch.cat([take(f"{p}self_attn.{n}_proj.bias") for n in ("q", "k", "v")])
            self.layers.append(
                Layer(
                    input_norm=take(f"{p}input_layernorm.weight"),
                    qkv_weight=torch.cat([q, k, v]),
                    qkv_bias=bias,
                    o_weight=take(f"{p}self_attn.o_proj.weight"),
                    post_norm=take(f"{p}post_attention_layernorm.weight"),
                    gate_up_weight=torch.cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")]),
                    down_weight=take(f"{p}mlp.down_proj.weight"),
                )
            )
        self.norm = take("model.norm.weight")
        if c.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight")
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        freqs = torch.outer(torch.arange(c.max_position_embeddings, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.pieces: ForwardPieces = EagerPieces(config)
        # Uniform decode steps read the KV pool in place (paged_decode_triton.py); set by the
        # engine from EngineSettings.decode_attention.
        self.decode_attention_triton = False

    @classmethod
    def from_pretrained(cls, model_dir: Path, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        config = load_model_config(model_dir)
        return cls(config, load_state_dict(model_dir), device, dtype)

    def allocate_kv_pools(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools, ``[layers, slots, kv_heads, head_dim]`` each, allocated once."""
        c = self.config
        shape = (c.num_hidden_layers, num_slots, c.num_key_value_heads, c.head_dim)
        return (
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_pools: torch.Tensor, v_pools: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":  # the backend choice matters on CUDA only; skip its cost
            return self._forward_varlen(batch, k_pools, v_pools)
        with sdpa_kernel(_SDPA_BACKENDS):
            return self._forward_varlen(batch, k_pools, v_pools)

    @torch.inference_mode()
    def forward_uniform(
        self, batch: UniformBatch, k_pools: torch.Tensor, v_pools: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Logits (float32) of each sequence's ``logits_rows`` of a uniform step (``step_shapes.py``):
        every shape is fixed by the step's bucket, and nothing here reads a tensor back to the host,
        so on CUDA the whole call can be captured as a graph and replayed."""
        c = self.config
        if self.decode_attention_triton and batch.shape.query == 1:
            h = self._layers(
                batch,
                batch.shape.rows,
                lambda i, q, k, v: _triton_decode(q, k, v, k_pools[i], v_pools[i], batch, block_size),
            )
            return self._logits(h, batch.logits_rows, batch.shape.batch)
        mask = causal_mask(batch, c.num_attention_heads // c.num_key_value_heads, block_size)
        with sdpa_kernel(_SDPA_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext():
            h = self._layers(
                batch,
                batch.shape.rows,
                lambda i, q, k, v: block_table_attention(q, k, v, k_pools[i], v_pools[i], batch, block_size, mask),
            )
        return self._logits(h, batch.logits_rows, batch.shape.batch)

    def _forward_varlen(self, batch: ForwardBatch, k_pools: torch.Tensor, v_pools: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for ``batch.logits_rows``, after writing the batch's K/V into the pools.

        The dense parts run through ``self.pieces`` (eager, or compiled graphs with their shape
        buckets, see ``compiled_forward.py``); paged attention always runs eager between them.
        """
        h = self._layers(
            batch,
            batch.token_ids.shape[0],
            lambda i, q, k, v: paged_attention(q, k, v, k_pools[i], v_pools[i], batch),
        )
        return self._logits(h, batch.logits_rows, batch.logits_rows.shape[0])

    def _layers(
        self,
        batch: ForwardBatch | UniformBatch,
        rows: int,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The hidden states after every layer, for the batch's first ``rows`` tokens; ``attend(i,
        q, k, v)`` is layer i's attention (it also writes the K/V into the pools)."""
        pieces = self.pieces
        padded = pieces.padded_tokens(rows)
        token_ids, positions = batch.token_ids, batch.positions
        if padded != rows:
            # Padding rows (token 0 at position 0) are computed and dropped before attention, so
            # they never reach the KV pools or the logits.
            token_ids = F.pad(token_ids, (0, padded - rows))
            positions = F.pad(positions, (0, padded - rows))
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        h = self.embed.index_select(0, token_ids)
        for i, layer in enumerate(self.layers):
            q, k, v = pieces.attn_in(h, layer.input_norm, layer.qkv_weight, layer.qkv_bias, cos, sin)
            if padded != rows:
                q, k, v = q[:rows], k[:rows], v[:rows]
            attn = attend(i, q, k, v)
            if padded != rows:
                attn = F.pad(attn, (0, 0, 0, padded - rows))
            h = pieces.attn_out_mlp(h, attn, layer.o_weight, layer.post_norm, layer.gate_up_weight, layer.down_weight)
        return h

    def _logits(self, h: torch.Tensor, out_rows: torch.Tensor, count: int) -> torch.Tensor:
        """Logits (float32) of the ``count`` rows of ``h`` that ``out_rows`` names."""
        padded = self.pieces.padded_tokens(count)
        if padded != count:
            out_rows = F.pad(out_rows, (0, padded - count))
        logits = self.pieces.logits(h.index_select(0, out_rows), self.norm, self.lm_head)
        return logits[:count] if padded != count else logits


def _triton_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: UniformBatch,
    block_size: int,
) -> torch.Tensor:
    """A decode step's attention (one row per sequence): write its K/V, then read the pool in place."""
    k_pool.index_copy_(0, batch.slot_mapping, k)
    v_pool.index_copy_(0, batch.slot_mapping, v)
    return paged_decode_attention(q, k_pool, v_pool, batch.block_tables, batch.positions, block_size)
