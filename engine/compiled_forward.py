"""The forward pass's dense pieces through ``torch.compile`` (Inductor: C++ on CPU, Triton on CUDA).

Two ways to cover the step sizes the engine runs, chosen by ``EngineSettings.compile_dynamic``:

- **static buckets** (default): one graph per token-count bucket (the decode batch sizes,
  ``compile_sizes_tokens``). A step of ``n`` tokens is padded up to the smallest bucket that
  holds it; steps larger than every bucket (long prefill chunks) run eager. Each graph is
  specialised to its size, as vLLM's CUDA-graph sizes are.
- **dynamic**: one graph with a symbolic token count (``mark_dynamic``) serving every step size,
  plus the size-1 graph torch always specialises.

Every graph is compiled at start-up (:meth:`CompiledPieces.warm_up`), before the engine reports
healthy, so serving never waits on a compile; ``compile_cache.py`` makes that compile a cache hit
on the next start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvfleet.engine.compile_cache import (
    CacheCheck,
    compile_identity,
    discard,
    open_cache,
    write_manifest,
    write_start_report,
)
from kvfleet.engine.forward_pieces import DensePieces
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.settings import EngineSettings

if TYPE_CHECKING:
    from kvfleet.engine.model import LlamaModel

log = logging.getLogger(__name__)

# torch.compile's own default; the static mode needs one cache entry per bucket on top.
_DYNAMO_RECOMPILE_LIMIT = 8


def bucket_for(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_tokens``, or None when it is larger than all of them."""
    for size in sorted(sizes):
        if size >= num_tokens:
            return size
    return None


class CompiledPieces:
    """:class:`DensePieces` whose three functions run as compiled graphs for the covered sizes."""

    def __init__(self, config: ModelConfig, sizes_tokens: Sequence[int], *, dynamic: bool) -> None:
        self.sizes_tokens = tuple(sorted(set(sizes_tokens)))
        self.dynamic = dynamic
        self._eager = DensePieces(config)
        self._config = config
        import torch._dynamo.config as dynamo_config

        # Static buckets: every bucket is a guarded entry of the same three functions.
        needed = len(self.sizes_tokens) + 2
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _DYNAMO_RECOMPILE_LIMIT, needed)
        # dynamic=False pins each size; None (with mark_dynamic in warm_up) lets one graph take any size.
        mode: bool | None = False if not dynamic else None

        def compile_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(fn, dynamic=mode, fullgraph=True)

        self._attn_in = compile_fn(self._eager.attn_in)
        self._attn_out_mlp = compile_fn(self._eager.attn_out_mlp)
        self._logits = compile_fn(self._eager.logits)

    def covers(self, num_tokens: int) -> bool:
        return self.dynamic or num_tokens in self.sizes_tokens

    def padded_tokens(self, num_tokens: int) -> int:
        if self.dynamic:
            return num_tokens
        return bucket_for(num_tokens, self.sizes_tokens) or num_tokens

    def attn_in(
        self,
        h: torch.Tensor,
        norm_w: torch.Tensor,
        qkv_w: torch.Tensor,
        qkv_b: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fn = self._attn_in if self.covers(h.shape[0]) else self._eager.attn_in
        return fn(h, norm_w, qkv_w, qkv_b, cos, sin)

    def attn_out_mlp(
        self,
        h: torch.Tensor,
        attn: torch.Tensor,
        o_w: torch.Tensor,
        post_norm_w: torch.Tensor,
        gate_up_w: torch.Tensor,
        down_w: torch.Tensor,
    ) -> torch.Tensor:
        fn = self._attn_out_mlp if self.covers(h.shape[0]) else self._eager.attn_out_mlp
        return fn(h, attn, o_w, post_norm_w, gate_up_w, down_w)

    def logits(self, h: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        fn = self._logits if self.covers(h.shape[0]) else self._eager.logits
        return fn(h, norm_w, lm_head)

    def warm_up_sizes(self) -> tuple[int, ...]:
        # Dynamic: size 1 (always specialised) and one symbolic graph traced at size 2.
        return (1, 2) if self.dynamic else self.sizes_tokens

    @torch.inference_mode()
    def warm_up(self, model: LlamaModel) -> float:
        """Compile every graph now (seconds taken): the same inputs, dtypes and inference mode as a
        serving step, so no step ever recompiles."""
        started = time.monotonic()
        c = self._config
        layer = model.layers[0]
        dtype, device = model.dtype, model.device
        for size in self.warm_up_sizes():
            # Built by the same ops as in forward (inference tensors from index_select), so the
            # guards compiled here are the ones a serving step passes.
            rows = torch.zeros(size, dtype=torch.long, device=device)
            h = model.embed.index_select(0, rows)
            cos = model.cos.index_select(0, rows).unsqueeze(1)
            sin = model.sin.index_select(0, rows).unsqueeze(1)
            attn = torch.zeros(size, c.num_attention_heads * c.head_dim, dtype=dtype, device=device)
            if self.dynamic and size > 1:
                for t in (h, cos, sin, attn):
                    torch._dynamo.mark_dynamic(t, 0)
            self._attn_in(h, layer.input_norm, layer.qkv_weight, layer.qkv_bias, cos, sin)
            self._attn_out_mlp(h, attn, layer.o_weight, layer.post_norm, layer.gate_up_weight, layer.down_weight)
            self._logits(h, model.norm, model.lm_head)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.monotonic() - started


@dataclass(frozen=True)
class CompileResult:
    """One start's compile: how long it took and whether the on-disk cache served it."""

    seconds: float
    cache_hit: bool
    reason: str
    mode: str
    sizes_tokens: tuple[int, ...]


def compile_model(model: LlamaModel, model_dir: Path, settings: EngineSettings) -> CompileResult:
    """Compile ``model``'s forward pieces now, from ``settings.artifacts_dir``'s cache when it is
    valid for this model and machine; the model then serves through the compiled graphs."""
    sizes = tuple(sorted(settings.compile_sizes_tokens))
    dynamic = settings.compile_mode == "dynamic"
    directory = settings.artifacts_dir
    identity = compile_identity(model_dir, model.dtype, model.device, mode=settings.compile_mode, sizes_tokens=sizes)
    verdict = open_cache(directory, identity) if directory is not None else CacheCheck(False, "no --artifacts-dir")
    pieces = CompiledPieces(model.config, sizes, dynamic=dynamic)
    try:
        seconds = pieces.warm_up(model)
    except Exception as e:  # any failure to load a cached graph means: rebuild it
        if directory is None or not verdict.hit:
            raise
        # A cache that passed the identity check but cannot be loaded (damaged files) is
        # discarded and compiled from scratch: it costs the compile, never the start.
        log.warning("compile cache in %s could not be loaded (%s); compiling from scratch", directory, e)
        verdict = CacheCheck(False, f"compile cache unusable ({type(e).__name__}: {e}); rebuilt")
        torch._dynamo.reset()
        discard(directory)
        open_cache(directory, identity)
        pieces = CompiledPieces(model.config, sizes, dynamic=dynamic)
        seconds = pieces.warm_up(model)
    model.pieces = pieces
    if directory is not None:
        if not verdict.hit:
            write_manifest(directory, identity, compile_s=seconds)
        write_start_report(directory, verdict, compile_s=seconds)
    log.info(
        "compiled the forward pass (%s%s) in %.2f s, cache %s: %s",
        settings.compile_mode,
        f" sizes {list(sizes)}" if not dynamic else "",
        seconds,
        "hit" if verdict.hit else "miss",
        verdict.reason,
    )
    return CompileResult(seconds, verdict.hit, verdict.reason, settings.compile_mode, sizes if not dynamic else ())
