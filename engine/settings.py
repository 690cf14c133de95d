"""Typed, validated settings of the reference engine. Units are in the field names; every bound
is checked once here so the rest of the engine can trust them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvfleet.engine.kv_events import KVEventsConfig

DeviceChoice = Literal["auto", "cpu", "cuda"]
DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
CompileChoice = Literal["auto", "on", "off"]
CompileMode = Literal["dynamic", "static"]
AsyncSchedulingChoice = Literal["auto", "on", "off"]
DecodeAttentionChoice = Literal["auto", "triton", "gather"]

# Decode batch sizes compiled as static buckets (powers of two, as vLLM's CUDA-graph sizes).
DEFAULT_COMPILE_SIZES = (1, 2, 4, 8, 16)
MAX_COMPILE_SIZES = 16


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field}: {message}")


@dataclass(frozen=True)
class EngineSettings:
    """What the step loop and the KV cache need.

    The defaults suit a laptop CPU: 16-token blocks (vLLM's default, so prefix hashes line up
    with the router's block size), a 512-token step budget (long prompts are chunked so decodes
    keep flowing every step), and 256 queued requests before answering 429.
    """

    block_size_tokens: int = 16
    # 0 means "size the pool from kv_cache_memory_bytes".
    num_kv_blocks: int = 0
    # Used only when num_kv_blocks is 0: the KV pool's memory budget.
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 256
    # 0 means "the model's max_position_embeddings".
    max_model_len_tokens: int = 0
    enable_prefix_caching: bool = True
    device: DeviceChoice = "auto"
    dtype: DtypeChoice = "auto"
    # The step loop's idle wait; bounded so a stop request is seen promptly.
    idle_poll_s: float = 0.05
    # Torch intra-op threads; 0 keeps torch's default.
    torch_threads: int = 0
    seed: int = 0
    # The engine's artifacts: its torch.compile cache (compile_cache.py) and, with
    # runtime_weights_artifact, the weights in runtime layout (runtime_artifacts.py).
    artifacts_dir: Path | None = None
    # Also save/restore the weights in runtime layout there. Off: on CPU in float32 that copy is
    # as large as the weights and saves only the fuse pass (docs/engine_image.md, measured).
    runtime_weights_artifact: bool = False
    # torch.compile the forward pass's dense pieces (compiled_forward.py). auto: on for CUDA (Triton
    # kernels, vLLM's default there), off on CPU, where it was measured not to pay for its compile
    # (docs/benchmarks/engine_compile.md).
    compile: CompileChoice = "auto"
    # dynamic: one graph with a symbolic token count (compiles fastest, serves every step size);
    # static: one graph per size in compile_sizes_tokens, steps padded up to the next size.
    compile_mode: CompileMode = "dynamic"
    compile_sizes_tokens: tuple[int, ...] = DEFAULT_COMPILE_SIZES
    # On CUDA, capture each uniform step's bucket (decodes, short chunks) as a CUDA graph and replay
    # it (cuda_graphs.py), as vLLM does; off runs the same fixed shapes launched from Python.
    cuda_graphs: bool = True
    # Overlapped scheduling (engine_core.py, vLLM's async scheduling): step N+1 is scheduled and
    # launched before step N's sampled ids are read back, so the host's work hides behind the
    # device's. auto: on for CUDA; off on CPU, where the "device" is the host and nothing overlaps.
    async_scheduling: AsyncSchedulingChoice = "auto"
    # Uniform decode steps' attention (one query row per sequence): "triton" reads the KV pool in
    # place through the block tables (paged_decode_triton.py), "gather" copies each sequence's
    # blocks out and calls SDPA (block_table_attention.py; prefill and mixed steps always do).
    # auto: triton on CUDA where it imports, gather elsewhere (docs/engine.md, measured).
    decode_attention: DecodeAttentionChoice = "auto"
    # vLLM's --kv-events-config: publish the prefix cache's stored/evicted blocks (kv_events.py).
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    # Set: the model folder is still being filled by a weight pull (kvfleet.weight_stream); shards
    # load as they land, and a file that does not come within this many seconds of the previous
    # wait fails the load. None: the folder is complete.
    weights_arrival_timeout_s: float | None = None

    def __post_init__(self) -> None:
        self.kv_events.validate()
        _require(1 <= self.block_size_tokens <= 256, "block_size_tokens", "must be in [1, 256]")
        _require(self.num_kv_blocks >= 0, "num_kv_blocks", "must be >= 0 (0 sizes the pool from memory)")
        _require(self.kv_cache_memory_bytes >= 1 << 20, "kv_cache_memory_bytes", "must be >= 1 MiB")
        _require(1 <= self.max_num_seqs <= 4096, "max_num_seqs", "must be in [1, 4096]")
        _require(1 <= self.max_num_batched_tokens <= 1 << 20, "max_num_batched_tokens", "must be in [1, 1048576]")
        # Every running decode needs one token of the step budget, or the newest ones would stall.
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"must be >= max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step",
        )
        _require(0 <= self.max_waiting_requests <= 1 << 20, "max_waiting_requests", "must be in [0, 1048576]")
        _require(self.max_model_len_tokens >= 0, "max_model_len_tokens", "must be >= 0")
        _require(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "unknown dtype")
        _require(0 < self.idle_poll_s <= 5, "idle_poll_s", "must be in (0, 5]")
        _require(
            self.weights_arrival_timeout_s is None or 0 < self.weights_arrival_timeout_s <= 86_400,
            "weights_arrival_timeout_s",
            "must be in (0, 86400] seconds, or unset",
        )
        _require(0 <= self.torch_threads <= 1024, "torch_threads", "must be in [0, 1024]")
        _require(self.compile in ("auto", "on", "off"), "compile", "must be auto, on or off")
        _require(self.compile_mode in ("dynamic", "static"), "compile_mode", "must be dynamic or static")
        _require(self.async_scheduling in ("auto", "on", "off"), "async_scheduling", "must be auto, on or off")
        _require(
            self.decode_attention in ("auto", "triton", "gather"), "decode_attention", "must be auto, triton or gather"
        )
        sizes = self.compile_sizes_tokens
        _require(
            1 <= len(sizes) <= MAX_COMPILE_SIZES and len(set(sizes)) == len(sizes),
            "compile_sizes_tokens",
            f"must name 1 to {MAX_COMPILE_SIZES} distinct sizes",
        )
        _require(
            all(1 <= n <= self.max_num_batched_tokens for n in sizes),
            "compile_sizes_tokens",
            f"every size must be in [1, max_num_batched_tokens ({self.max_num_batched_tokens})]",
        )

    def compile_enabled(self, device_type: str) -> bool:
        """Whether to compile, with ``auto`` resolved for this device."""
        if self.compile != "auto":
            return self.compile == "on"
        return device_type == "cuda"

    def decode_attention_triton(self, device_type: str, triton_available: bool) -> bool:
        """Whether uniform decode steps use the Triton kernel, with ``auto`` resolved."""
        if self.decode_attention == "auto":
            return device_type == "cuda" and triton_available
        if self.decode_attention == "triton" and not triton_available:
            raise ValueError("decode_attention: triton is not importable in this install")
        return self.decode_attention == "triton"

    def async_scheduling_enabled(self, device_type: str) -> bool:
        """Whether steps overlap, with ``auto`` resolved for this device."""
        if self.async_scheduling != "auto":
            return self.async_scheduling == "on"
        return device_type == "cuda"


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP layer around the engine."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""
    # How long SIGTERM waits for in-flight requests before exiting anyway.
    drain_timeout_s: float = 600.0
    # Retry-After sent with 429 (queue full) and 503 (draining).
    retry_after_s: int = 1
    # How often a non-streaming handler checks whether its client went away.
    disconnect_poll_s: float = 0.25
    # Largest request body accepted.
    max_request_bytes: int = 8 * 1024 * 1024
    # Front-end bounds, the router's (engine/connection_guard.py): a larger head or more header
    # fields get 431, a head slower than head_timeout_s gets 408, connections past the caps 503.
    max_head_bytes: int = 32 * 1024
    max_headers: int = 100
    head_timeout_s: float = 60.0
    max_connections: int = 4096
    max_connections_per_client: int = 4096

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        _require(0 <= self.drain_timeout_s <= 86400, "drain_timeout_s", "must be in [0, 86400]")
        _require(1 <= self.retry_after_s <= 3600, "retry_after_s", "must be in [1, 3600]")
        _require(0 < self.disconnect_poll_s <= 10, "disconnect_poll_s", "must be in (0, 10]")
        _require(1024 <= self.max_request_bytes <= 1 << 30, "max_request_bytes", "must be in [1 KiB, 1 GiB]")
        _require(1024 <= self.max_head_bytes <= 1 << 20, "max_head_bytes", "must be in [1 KiB, 1 MiB]")
        _require(8 <= self.max_headers <= 10_000, "max_headers", "must be in [8, 10000]")
        _require(0 < self.head_timeout_s <= 3600, "head_timeout_s", "must be in (0, 3600]")
        _require(1 <= self.max_connections <= 1_000_000, "max_connections", "must be in [1, 1000000]")
        _require(
            1 <= self.max_connections_per_client <= 1_000_000,
            "max_connections_per_client",
            "must be in [1, 1000000]",
        )
