"""``kvfleet engine``'s own commands: serve a model, or build a tiny random-weight one.

The engine images' ``kvfleet engine launch`` joins this group in ``kvfleet.engine_image.launch_cli``:
the launcher may import the engine, never the reverse (the engine is a leaf)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import click


@click.group()
def engine() -> None:
    """The reference engine (CPU/CUDA): serve a model with the vLLM-compatible API."""


@engine.command()
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json); with "
    "--weights-arrival-timeout-s, the folder a weight pull is still filling (it may not exist yet).",
)
@click.option(
    "--host",
    default="0.0.0.0",
    show_default=True,
    help="Address to bind; all interfaces by default, as vLLM does (pods are reached through a Service).",
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
@click.option("--served-model-name", default="", help="Name clients put in 'model' (default: the --model argument).")
@click.option(
    "--kv-blocks",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="KV cache blocks; 0 sizes the pool from --kv-cache-memory-mib.",
)
@click.option("--kv-cache-memory-mib", default=512, show_default=True, type=click.IntRange(1))
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(1, 256), help="Tokens per KV block.")
@click.option(
    "--max-num-seqs",
    default=64,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Most sequences running at once.",
)
@click.option(
    "--max-num-batched-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(1),
    help="Token budget per step; longer prompts are prefilled in chunks.",
)
@click.option(
    "--max-waiting",
    default=256,
    show_default=True,
    type=click.IntRange(0),
    help="Queued requests beyond the running ones before answering 429.",
)
@click.option(
    "--max-model-len",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Context length; 0 takes the model's max_position_embeddings.",
)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option(
    "--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"])
)
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    default=600.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds SIGTERM waits for in-flight requests.",
)
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0), help="Torch threads (0: default).")
@click.option(
    "--artifacts-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Engine artifacts (the compile cache; runtime weights with --runtime-weights-artifact), reused when "
    "valid; the launcher restores them from the weight cache.",
)
@click.option(
    "--runtime-weights-artifact/--no-runtime-weights-artifact",
    default=False,
    show_default=True,
    help="Also keep the weights in runtime layout in --artifacts-dir (as large as the weights).",
)
@click.option(
    "--compile",
    "compile_choice",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "on", "off"]),
    help="torch.compile the forward pass; auto: on for CUDA, off on CPU (measured not to pay there).",
)
@click.option(
    "--compile-mode",
    default="dynamic",
    show_default=True,
    type=click.Choice(["dynamic", "static"]),
    help="dynamic: one graph for every step size; static: one graph per --compile-sizes bucket.",
)
@click.option(
    "--compile-sizes",
    default="1,2,4,8,16",
    show_default=True,
    help="Static buckets: the step token counts (decode batch sizes) compiled; larger steps run eager.",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=True,
    show_default=True,
    help="On CUDA, capture each decode/short-chunk step bucket as a CUDA graph and replay it (as vLLM does).",
)
@click.option(
    "--async-scheduling",
    "async_scheduling",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "on", "off"]),
    help="Schedule and launch step N+1 before step N's sampled ids are read back (vLLM's async scheduling); "
    "auto: on for CUDA, off on CPU.",
)
@click.option(
    "--decode-attention",
    "decode_attention",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "triton", "gather"]),
    help="Decode steps' attention: triton reads the paged KV cache in place; gather copies the blocks out for "
    "SDPA; auto: triton on CUDA where it imports.",
)
@click.option(
    "--kv-events-config",
    default=None,
    help='vLLM\'s KV-cache events as JSON, e.g. {"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://*:5557"}: ZeroMQ PUB batches of BlockStored/BlockRemoved the router subscribes to.',
)
@click.option(
    "--weights-arrival-timeout-s",
    type=click.FloatRange(0, 86_400, min_open=True),
    default=None,
    help="Load each shard as the weight pull verifies it into --model, while later ones still download; "
    "fail when a file does not arrive within this many seconds of the previous one.",
)
def serve(
    model_dir: Path,
    host: str,
    port: int,
    served_model_name: str,
    kv_blocks: int,
    kv_cache_memory_mib: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_waiting: int,
    max_model_len: int,
    device: str,
    dtype: str,
    enable_prefix_caching: bool,
    drain_timeout_s: float,
    threads: int,
    artifacts_dir: Path | None,
    runtime_weights_artifact: bool,
    compile_choice: str,
    compile_mode: str,
    compile_sizes: str,
    cuda_graphs: bool,
    async_scheduling: str,
    decode_attention: str,
    kv_events_config: str | None,
    weights_arrival_timeout_s: float | None,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    from kvfleet.engine.extras import require_engine_extra

    require_engine_extra("kvfleet engine serve")
    from kvfleet.engine.kv_events import KVEventsConfig
    from kvfleet.engine.lifecycle import serve as run_server
    from kvfleet.engine.settings import EngineSettings, ServerSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if weights_arrival_timeout_s is None and not model_dir.is_dir():
        raise click.BadParameter(f"{model_dir} is not a directory", param_hint="--model")
    try:
        try:
            sizes = tuple(int(n) for n in compile_sizes.split(",") if n.strip())
        except ValueError as e:
            raise ValueError(f"compile_sizes_tokens: {compile_sizes!r} is not a comma-separated integer list") from e
        engine_settings = EngineSettings(
            block_size_tokens=block_size,
            num_kv_blocks=kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_mib * 1024 * 1024,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_waiting_requests=max_waiting,
            max_model_len_tokens=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            device=device,  # type: ignore[arg-type]
            dtype=dtype,  # type: ignore[arg-type]
            torch_threads=threads,
            artifacts_dir=artifacts_dir,
            runtime_weights_artifact=runtime_weights_artifact,
            compile=compile_choice,  # type: ignore[arg-type]
            compile_mode=compile_mode,  # type: ignore[arg-type]
            compile_sizes_tokens=sizes,
            cuda_graphs=cuda_graphs,
            async_scheduling=async_scheduling,  # type: ignore[arg-type]
            decode_attention=decode_attention,  # type: ignore[arg-type]
            kv_events=KVEventsConfig.from_json(kv_events_config) if kv_events_config else KVEventsConfig(),
            weights_arrival_timeout_s=weights_arrival_timeout_s,
        )
        server_settings = ServerSettings(
            host=host, port=port, served_model_name=served_model_name, drain_timeout_s=drain_timeout_s
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    sys.exit(asyncio.run(run_server(model_dir, engine_settings, server_settings)))


@engine.command("make-tiny-model")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--layers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--hidden", default=64, show_default=True, type=click.IntRange(8))
@click.option("--vocab", default=1024, show_default=True, type=click.IntRange(300))
@click.option("--heads", default=4, show_default=True, type=click.IntRange(1))
@click.option("--kv-heads", default=2, show_default=True, type=click.IntRange(1))
@click.option("--intermediate", default=0, show_default=True, type=click.IntRange(0), help="0: about 8/3 * hidden.")
@click.option("--max-position-embeddings", default=2048, show_default=True, type=click.IntRange(16))
@click.option("--tie-word-embeddings", is_flag=True)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--words-only",
    is_flag=True,
    help="Generate only whole words, so any output re-tokenizes exactly (stream continuation tests).",
)
@click.option(
    "--shards", default=1, show_default=True, type=click.IntRange(1, 999), help="Safetensors files (with an index)."
)
@click.option("--overwrite", is_flag=True, help="Replace PATH if it exists.")
def make_tiny_model_command(
    path: Path,
    layers: int,
    hidden: int,
    vocab: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    seed: int,
    words_only: bool,
    shards: int,
    overwrite: bool,
) -> None:
    """Write a random-weight Llama model with a locally trained tokenizer to PATH."""
    from kvfleet.engine.extras import require_engine_extra

    require_engine_extra("kvfleet engine make-tiny-model")
    from kvfleet.engine.tiny_model import make_tiny_model

    try:
        out = make_tiny_model(
            path,
            overwrite=overwrite,
            layers=layers,
            hidden=hidden,
            vocab=vocab,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            seed=seed,
            words_only=words_only,
            shards=shards,
        )
    except (ValueError, FileExistsError) as e:
        raise click.UsageError(str(e)) from e
    click.echo(f"wrote {out}")
