"""The dense parts of a decoder layer as three functions of plain tensors.

A layer is: [input norm, q/k/v projection, RoPE] -> paged attention -> [o projection, residual,
post norm, SwiGLU MLP, residual]; the model ends with [final norm, lm_head]. The bracketed parts
are what torch.compile can fuse; paged attention (data-dependent gathers over a growing context)
stays eager between them, as vLLM splits its compiled graph at attention. The weights are
arguments, not captured constants, so one compiled graph serves every layer.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvfleet.engine.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, heads, D]``; cos/sin: ``[T, 1, D]``. The rotate-half convention of HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DensePieces:
    """The three dense functions, bound to one model's sizes (plain Python: torch.compile traces these)."""

    def __init__(self, config: ModelConfig) -> None:
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_dim = self.heads * self.head_dim
        self.kv_dim = self.kv_heads * self.head_dim

    def attn_in(
        self,
        h: torch.Tensor,
        norm_w: torch.Tensor,
        qkv_w: torch.Tensor,
        qkv_b: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h [T, hidden]`` -> rotated ``q [T, H, D]``, ``k [T, KVH, D]`` and ``v [T, KVH, D]``."""
        n = h.shape[0]
        qkv = F.linear(rms_norm(h, norm_w, self.eps), qkv_w, qkv_b)
        q = qkv[:, : self.q_dim].reshape(n, self.heads, self.head_dim)
        k = qkv[:, self.q_dim : self.q_dim + self.kv_dim].reshape(n, self.kv_heads, self.head_dim)
        v = qkv[:, self.q_dim + self.kv_dim :].reshape(n, self.kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attn_out_mlp(
        self,
        h: torch.Tensor,
        attn: torch.Tensor,
        o_w: torch.Tensor,
        post_norm_w: torch.Tensor,
        gate_up_w: torch.Tensor,
        down_w: torch.Tensor,
    ) -> torch.Tensor:
        """The residual stream after attention's output projection and the MLP."""
        h = h + F.linear(attn, o_w)
        gate, up = F.linear(rms_norm(h, post_norm_w, self.eps), gate_up_w).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, down_w)

    def logits(self, h: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """float32 logits of the rows in ``h``."""
        return F.linear(rms_norm(h, norm_w, self.eps), lm_head).float()


class ForwardPieces(Protocol):
    """What ``LlamaModel.forward`` calls: the dense functions and the row count a step is padded to."""

    def padded_tokens(self, num_tokens: int) -> int: ...

    def attn_in(
        self,
        h: torch.Tensor,
        norm_w: torch.Tensor,
        qkv_w: torch.Tensor,
        qkv_b: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def attn_out_mlp(
        self,
        h: torch.Tensor,
        attn: torch.Tensor,
        o_w: torch.Tensor,
        post_norm_w: torch.Tensor,
        gate_up_w: torch.Tensor,
        down_w: torch.Tensor,
    ) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor: ...


class EagerPieces(DensePieces):
    """The dense functions run op by op; no padding."""

    def padded_tokens(self, num_tokens: int) -> int:
        return num_tokens
