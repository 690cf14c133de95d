"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy (vLLM's threshold).
GREEDY_TEMPERATURE = 1e-5
# vLLM's kv_cache_report_mode values (``vllm_xargs``): "full" re-announces the prefix-cache blocks a
# request hits as a BlockStored, so a subscriber that joined late learns a long-cached prefix.
REPORT_MODES = ("incremental", "full")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    kv_cache_report_mode: str = REPORT_MODES[0]  # see REPORT_MODES

    def __post_init__(self) -> None:
        # The HTTP layer reports these per field; this guards direct Python callers.
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if not 0 <= self.temperature <= 2:
            raise ValueError("temperature: must be in [0, 2]")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p: must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k: must be -1, 0 (disabled) or >= 1")
        if self.kv_cache_report_mode not in REPORT_MODES:
            raise ValueError("vllm_xargs.kv_cache_report_mode: must be 'incremental' or 'full'")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (1-D logits)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first is always kept.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One next token per row of ``logits`` (``[rows, vocab]``, float32), as a tensor on the
    logits' device: nothing is read back to the host, so the caller copies all ids at once."""
    out = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        row_logits = filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row_logits, dim=-1)
        out[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """:func:`sample_tokens`, read back as Python ints."""
    return [int(t) for t in sample_tokens(logits, params, generators).tolist()]
